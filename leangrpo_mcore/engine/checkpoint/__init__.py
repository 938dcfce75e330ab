"""Training checkpoints: sharded (each rank writes its own shards), verified, reshardable on load.

A checkpoint ``OUTPUT_DIR/checkpoints/step_<N>/`` holds::

    dcp/                  torch.distributed.checkpoint files: every rank's shards of the model
                          (``model/<name>``), optimizer state (``optim/<name>/<key>``) and EMA (``ema/<name>``),
                          each stored as boxes of the FULL tensor; modules' extra state (Transformer Engine's
                          FP8 metadata) per TP rank (``extra/<module>._extra_state/tp_<r>``, see
                          :mod:`~leangrpo_mcore.engine.checkpoint.extra_state`)
    leangrpo_model.json   the policy's family, hyper-parameters and LoRA record (``leangrpo-convert`` and
                          ``model.path`` read the weights from ``dcp/``)
    optimizer.json        parameter groups, non-tensor optimizer state, LR-schedule position
    rng/rank_<r>.pt       python, numpy, torch CPU and CUDA generator states of rank r
    trainer_state.json    step, data sampler position, world/TP layout, counters
    config.yaml           the resolved config of the run that wrote it
    COMPLETE              written last: every file above with its size and CRC-32

The modules, by what a reader looks for:

    format.py       the file names and format version above; reading trainer_state.json and config.yaml
    state.py        a rank's shards as a DCP state dict (boxes of the FULL tensor), the optimizer record, RNG
    save.py         writing a checkpoint (synchronously or in the background): save_checkpoint, PendingSave,
                    CheckpointWriter (a run's writes, one at a time)
    publish.py      checksumming, the COMPLETE marker and the atomic rename; pruning old checkpoints
    manifest.py     the marker's file list and CRC-32s; verification shared out over the ranks
    load.py         loading at this run's layout: load_checkpoint, or the weights and EMA alone: load_weights
    resume.py       which checkpoint checkpoint.resume names: resolve_resume (verified; damaged ones set aside,
                    a run directory of damaged ones refused), and whether it fits this run (the same model; the
                    config changes it allows)
    verify.py       the one check every reader of a checkpoint makes first: verify_before_reading
    extra_state.py  modules' extra state (Transformer Engine's FP8 metadata) per TP rank

The names below are the package's interface (the trainer, evaluation, tools and tests use them); the modules'
other names are theirs. The run directory's layout, the ``COMPLETE`` marker's name included, comes from
:mod:`~leangrpo_mcore.engine.output.run_dir`, which imports nothing of this package.
"""

from leangrpo_mcore.engine.checkpoint.format import STATE_FILE, list_complete, read_state, saved_config
from leangrpo_mcore.engine.checkpoint.load import load_checkpoint, load_weights
from leangrpo_mcore.engine.checkpoint.publish import prune
from leangrpo_mcore.engine.checkpoint.resume import AUTO, FRESH_IF_DAMAGED, resolve_resume
from leangrpo_mcore.engine.checkpoint.save import CheckpointWriter, PendingSave, save_checkpoint
from leangrpo_mcore.engine.checkpoint.verify import verify_before_reading
from leangrpo_mcore.models.common.tp import capture_tp_layout

__all__ = ["AUTO", "FRESH_IF_DAMAGED", "STATE_FILE", "CheckpointWriter", "PendingSave", "capture_tp_layout",
           "list_complete", "load_checkpoint", "load_weights", "prune", "read_state", "resolve_resume",
           "save_checkpoint", "saved_config", "verify_before_reading"]
