"""GroupedRouting: how a DeepSeek-style router chooses and weighs experts (kernels.moe.routing
computes it), with the checks of its fields. Free of torch and Triton, so configs can hold one."""

from __future__ import annotations

from dataclasses import dataclass

SCORING_FUNCS = ("softmax", "sigmoid")
# topk_method -> the scoring function it takes.
TOPK_METHODS = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


@dataclass(frozen=True)
class GroupedRouting:
    """How a DeepSeek-style router turns logits into (weights, expert ids); see kernels.moe.routing."""

    top_k: int
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    scaling: float = 1.0

    @property
    def scoring_func(self) -> str:
        return TOPK_METHODS[self.topk_method]

    def check(self, num_experts: int) -> None:
        """ValueError naming the field that does not fit `num_experts`."""
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {', '.join(TOPK_METHODS)}, got {self.topk_method!r}")
        if not isinstance(self.n_group, int) or self.n_group < 1 or num_experts % self.n_group:
            raise ValueError(f"n_group must be a positive divisor of the {num_experts} experts, got {self.n_group!r}")
        if not isinstance(self.topk_group, int) or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be an int in 1..n_group ({self.n_group}), got {self.topk_group!r}")
        per_group = num_experts // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(
                f"noaux_tc scores a group by its best two experts: n_group ({self.n_group}) leaves {per_group}"
            )
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok must be in 1..{self.topk_group * per_group} (the experts of topk_group "
                f"{self.topk_group} groups of {per_group}), got {self.top_k!r}"
            )
        if not self.scaling > 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.scaling!r}")

    @property
    def limits_groups(self) -> bool:
        return self.topk_method != "greedy" and self.topk_group < self.n_group
