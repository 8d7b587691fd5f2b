"""Which checkpoint entries are training state (optimizer moments, step counters), not model weights.

MindFormers 2.x splits a Checkpoint 2.0 rank's tensors into ``model-…`` and ``opt-…`` files by
asking the running network which names it owns; an offline tool has no network, so it decides by
name. The rule lives here, at the bottom of the house, so that every feature that needs "model or
training state?" (writing Checkpoint 2.0, a weights-only filter) answers it the same way.

The defaults are the names MindSpore's and MindFormers' optimizers and training wrappers give
their state (read from MindFormers 2.1.0 and MindSpore 2.10): per-parameter clones named
``<prefix>.<parameter>`` (AdamW ``adam_m``/``adam_v``, Muon ``muon_m``, fused AdamW ``exp_avg``/
``exp_avg_sq``/``max_exp_avg_sq``, Momentum ``moments``, gradient accumulation ``accu_grads``, …),
CAME's ``exp_avg_sq_row_<parameter>`` family, and single entries (``global_step``,
``learning_rate``, ``beta1_power``, loss-scale counters, and the ``epoch_num``/``step_num``/
``loss_scale`` scalars MindFormers 1.x appended to its ``.ckpt`` files). PyTorch checkpoints name
theirs under one key: megatron-core's distributed optimizer saves ``optimizer.state.exp_avg.<param>``,
``optimizer.state.exp_avg_sq.<param>``, ``optimizer.state.fp32_param.<param>`` and
``optimizer.distributed.…`` objects (``chained_<i>.optimizer.…`` when several optimizers are
chained), Megatron-LM its ``rng_state`` and ``rerun_state_machine_state`` objects, and a DCP save of
``torch.distributed.checkpoint.state_dict``'s optimizer state (torchtitan, torchtune) its flattened
``optimizer.state.<fqn>.exp_avg`` / ``optim.param_groups.<fqn>.lr`` entries. A user adds prefixes for
an optimizer of their own (``StateNames.with_prefixes``; the CLI's ``--optimizer-prefix``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# Per-parameter optimizer state that is a whole clone of its parameter (the same global shape):
# ``<prefix><parameter name>``. ``plan/agree`` checks that each has its parameter's shape.
CLONE_PREFIXES: tuple[str, ...] = (
    "adam_m.",
    "adam_v.",
    "accu_grads.",
    "muon_m.",
    "exp_avg.",
    "exp_avg_sq.",
    "max_exp_avg_sq.",
    "moments.",
    "moment1.",
    "moment2.",
    "lamb_m.",
    "lamb_v.",
    "accum.",
)

# Per-parameter optimizer state: ``<prefix><parameter name>`` (the clones, and CAME's factored
# row/column states and the like, whose shapes differ from their parameter's).
OPTIMIZER_PREFIXES: tuple[str, ...] = (
    *CLONE_PREFIXES,
    "pma_weight_",
    "exp_avg_sq_row_",
    "exp_avg_sq_col_",
    "exp_avg_insta_row_",
    "exp_avg_insta_col_",
    "exp_avg_sq_",
    "optimizer.",  # megatron-core's and a DCP optimizer state dict's (torchtitan)
    "optim.",  # a DCP optimizer state dict saved under "optim" (torchtune)
    "rng_state/",  # Megatron-LM's ShardedObjects: "<key>/shard_<offsets>_<shape>"
    "rerun_state_machine_state/",
)

# megatron-core's ChainedOptimizer puts "chained_<i>." before each optimizer's keys
_CHAINED = re.compile(r"chained_\d+\.")

# Single training-state entries, matched by their whole name.
OPTIMIZER_NAMES: frozenset[str] = frozenset(
    {
        "global_step",
        "learning_rate",
        "beta1_power",
        "beta2_power",
        "scale_sense",
        "current_iterator_step",
        "last_overflow_iterator_step",
        "afactor_step",
        "epoch_num",
        "step_num",
        "loss_scale",
        "rng_state",
        "rerun_state_machine_state",
    }
)


@dataclass(frozen=True)
class StateNames:
    """A rule "is this entry training state?": a name in ``names``, or starting with one of ``prefixes``."""

    prefixes: tuple[str, ...] = OPTIMIZER_PREFIXES
    names: frozenset[str] = OPTIMIZER_NAMES

    def is_state(self, name: str) -> bool:
        """Whether ``name`` is optimizer / training state (True) or a model weight (False).

        Args:
            name: A checkpoint entry's name.

        Returns:
            True for training state, False for a model weight.

        Example:
            from reshard.statenames import StateNames
            assert StateNames().is_state("adam_m.embedding.weight")
            assert not StateNames().is_state("embedding.weight")
        """
        if name in self.names or name.startswith(self.prefixes):
            return True
        chained = _CHAINED.match(name)
        return chained is not None and name.startswith(self.prefixes, chained.end())

    def prefix_of(self, name: str) -> str | None:
        """The state prefix ``name`` starts with, a ChainedOptimizer's ``chained_<i>.`` included (None: none).

        Example:
            from reshard.statenames import StateNames
            assert StateNames().prefix_of("chained_1.optimizer.state.exp_avg.w") == "chained_1.optimizer."
            assert StateNames().prefix_of("adam_m.w") == "adam_m." and StateNames().prefix_of("w") is None
        """
        chained = _CHAINED.match(name)
        if chained is not None:
            inner = next((p for p in self.prefixes if name.startswith(p, chained.end())), None)
            if inner is not None:
                return chained.group() + inner
        return next((p for p in self.prefixes if name.startswith(p)), None)

    def with_prefixes(self, extra: Iterable[str]) -> StateNames:
        """This rule with more prefixes (an optimizer of one's own).

        Args:
            extra: Prefixes to add (empty ones are ignored).

        Returns:
            A new ``StateNames``.

        Example:
            from reshard.statenames import StateNames
            rule = StateNames().with_prefixes(["my_opt."])
            assert rule.is_state("my_opt.w")
        """
        added = tuple(p for p in extra if p and p not in self.prefixes)
        return StateNames(self.prefixes + added, self.names)


DEFAULT = StateNames()

__all__ = ["CLONE_PREFIXES", "DEFAULT", "OPTIMIZER_NAMES", "OPTIMIZER_PREFIXES", "StateNames"]
