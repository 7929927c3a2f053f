"""Model-agnostic distributed machinery (torchtitan's `distributed/`): the process mesh, collectives and gradient
sync (dist), FSDP2 over caller-given blocks and shard-local copies (fsdp), the Ulysses all-to-alls and split/gather
hooks (ulysses), Muon on row shards (muon). What is specific to HunyuanVideo-1.5 (its blocks, meta build, sharded
load, sequence-parallel processor) is in `sage_grpo.models.parallelize` / `sage_grpo.models.sequence_parallel`."""
