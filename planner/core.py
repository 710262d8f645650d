"""The planner core: ``decide(observation, policy, state) -> Decision``.

A pure discrete-event step with no I/O and no clock of its own (time comes in the
observation), so the live planner, the simulator and the tests run this same function
and, given the same observations, make the same decisions.  Each pool first reads its
own rules (``rules.evaluate``); the GPU budget then arbitrates between the pools,
turning a blocked scale-up into a move when the other pool is shrinking anyway.
"""

from __future__ import annotations

from dataclasses import replace

from .config import GpuBudget, PlannerPolicy
from .model import POOLS, Action, Decision, Hold, Move, Observation, PlannerState, Scale
from .rules import Proposal, evaluate


def decide(observation: Observation, policy: PlannerPolicy, state: PlannerState) -> Decision:
    """Called once per interval (live, in replay, in tests); returns the interval's actions
    (one per scaled pool: a scale, a hold, or one move covering both), the next state and
    per-pool diagnostics.  ``state`` is not modified."""
    proposals: dict[str, Proposal] = {}
    actions: dict[str, Action] = {}
    diagnostics = {}
    next_state = replace(state, intervals=state.intervals + 1)
    for pool, cfg in policy.pools().items():
        obs = observation.pool(pool)
        if obs is None:
            actions[pool] = Hold(pool, "no-data", "no observation of this pool")
            continue
        proposals[pool], pool_state, diagnostics[pool] = evaluate(
            pool, cfg, obs, observation, state.pool(pool), policy.planner)
        next_state = next_state.with_pool(pool, pool_state)
    actions.update(_arbitrate(proposals, policy.planner.gpu_budget, observation))
    ordered = _apply_order(actions)
    return Decision(ordered, _remember(ordered, next_state, observation), diagnostics)


def _as_action(p: Proposal) -> Action:
    if p.direction == "hold" or p.target == p.replicas:
        return Hold(p.pool, p.reason, p.detail)
    return Scale(p.pool, p.target - p.replicas, p.target, p.reason, p.detail)


def _gpus_in_use(observation: Observation, budget: GpuBudget) -> tuple[int | None, str]:
    used = 0
    for pool in ("prefill", "decode"):
        obs = observation.pool(pool)
        if obs is None:
            return None, f"replicas of {pool} unknown"
        used += obs.replicas * budget.per_replica(pool)
    return used, ""


def _arbitrate(props: dict[str, Proposal], budget: GpuBudget | None,
               observation: Observation) -> dict[str, Action]:
    """Fit the pools' scale-ups into the GPU budget; scale-downs always pass.

    Scale-ups are served by pressure (highest signal/threshold ratio first).  A scale-up
    that gets no GPU becomes a move when the other pool proposes to shrink: the freed
    replica is retasked instead of released.  GPUs freed by a plain scale-down are not
    lent to the other pool in the same interval, because draining takes time.
    """
    if budget is None:
        return {pool: _as_action(p) for pool, p in props.items()}
    out: dict[str, Action] = {p: _as_action(prop) for p, prop in props.items()
                              if prop.direction != "up"}
    used, unknown = _gpus_in_use(observation, budget)
    free = None if used is None else budget.total_gpus - used
    ups = sorted((p for p in props.values() if p.direction == "up"),
                 key=lambda p: (-p.pressure, p.pool != "prefill"))
    for up in ups:
        want, per = up.target - up.replicas, budget.per_replica(up.pool)
        if free is None:
            out[up.pool] = Hold(up.pool, "budget", f"{up.detail}; {unknown}")
            continue
        fit = min(want, max(free, 0) // per)
        if fit > 0:
            note = "" if fit == want else f"; GPU budget allows {fit} of {want}"
            out[up.pool] = Scale(up.pool, fit, up.replicas + fit, up.reason,
                                 up.detail + note)
            free -= fit * per
            continue
        donor = props.get("decode" if up.pool == "prefill" else "prefill")
        spent = f"GPU budget spent ({used}/{budget.total_gpus})"
        if budget.moves and donor is not None and donor.direction == "down":
            count = min(want, donor.replicas - donor.target)
            move = Move(donor.pool, up.pool, count, donor.replicas - count,
                        up.replicas + count, "move",
                        f"{spent}; {up.pool}: {up.detail}; {donor.pool}: {donor.detail}")
            out[up.pool] = out[donor.pool] = move
        else:
            out[up.pool] = Hold(up.pool, "budget", f"{up.detail}; {spent}")
    return out


def _apply_order(actions: dict[str, Action]) -> list[Action]:
    """Moves, then scale-downs, then scale-ups, then holds: capacity is released before
    it is claimed, so a connector applying them in order stays within the budget."""
    unique: list[Action] = []
    for a in actions.values():
        if a not in unique:
            unique.append(a)

    def rank(a: Action) -> tuple[int, int]:
        if isinstance(a, Move):
            return 0, 0
        order = POOLS.index(a.pool)
        if isinstance(a, Scale):
            return (1 if a.delta < 0 else 2), order
        return 3, order

    return sorted(unique, key=rank)


def _remember(actions: list[Action], state: PlannerState, obs: Observation) -> PlannerState:
    """Stamp cooldowns, reset streaks and record desired replicas after the actions."""
    now = obs.time_s

    def changed(st: PlannerState, pool: str, target: int, up: bool) -> PlannerState:
        ps = replace(st.pool(pool), up_streak=0, down_streak=0, last_change_s=now,
                     desired=target)
        if up:
            ps = replace(ps, last_up_s=now)
        return st.with_pool(pool, ps)

    for a in actions:
        if isinstance(a, Move):
            state = changed(state, a.source, a.source_target, up=False)
            state = changed(state, a.dest, a.dest_target, up=True)
        elif isinstance(a, Scale):
            state = changed(state, a.pool, a.target, up=a.delta > 0)
        elif (seen := obs.pool(a.pool)) is not None:
            state = state.with_pool(a.pool, replace(state.pool(a.pool), desired=seen.replicas))
    return state
