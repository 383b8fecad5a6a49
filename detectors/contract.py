"""The tool contract applied to one call (docs/CONTRACTS.md §4): arguments merged with the
contract's defaults and normalized, the action fingerprint over the identity arguments, and
the contract's fields read from the result (version, state, cursor, new items, the side
effect's business identity and idempotency key). Only digests leave."""

from __future__ import annotations

import json
from typing import Any

from .fingerprint import Fingerprinter
from .model import Step
from .policy import Policy, ToolContract

MAX_ITEMS = 64  # new items digested per result


def contract_args(args: dict[str, Any], contract: ToolContract | None) -> dict[str, Any]:
    if contract is None:
        return args
    merged = dict(contract.defaults)
    merged.update(args)
    for arg, ops in contract.normalize.items():
        if arg in merged:
            merged[arg] = apply_ops(merged[arg], ops)
    return merged


def apply_ops(value: Any, ops: tuple[str, ...]) -> Any:
    """The normalization a tool contract declares for one argument (and only that)."""
    for op in ops:
        if isinstance(value, str):
            if op == "trim":
                value = value.strip()
            elif op == "lowercase":
                value = value.lower()
            elif op == "collapse_whitespace":
                value = " ".join(value.split())
        elif op == "sort" and isinstance(value, list):
            value = sorted(value, key=lambda v: json.dumps(v, sort_keys=True, default=str))
    return value


def action_fp(
    fp: Fingerprinter, tool: str, args: dict[str, Any], contract: ToolContract | None
) -> str:
    merged = contract_args(args, contract)
    if contract is not None:
        if contract.identity is not None:
            merged = {k: merged.get(k) for k in contract.identity}
        else:
            merged = without_attempt_args(merged, contract)
    return fp.of_value(tool, merged)


def without_attempt_args(merged: dict[str, Any], contract: ToolContract) -> dict[str, Any]:
    """The arguments without the cursor and the idempotency key: the cursor selects a page
    and the key an attempt; neither defines the action (progress rules look at them
    separately)."""
    drop = {a for a in (contract.cursor_arg, contract.idempotency_key_arg) if a is not None}
    return {k: v for k, v in merged.items() if k not in drop} if drop & merged.keys() else merged


def fill_action(
    fp: Fingerprinter, step: Step, contract: ToolContract, args: dict[str, Any]
) -> None:
    """The contract's fields the call's arguments give: its cursor, and a side effect's
    business identity and idempotency key (known before the call is dispatched)."""
    if contract.cursor_arg is not None:
        step.cursor_fp = fp.of_value("cursor", args.get(contract.cursor_arg))
    if contract.side_effect:
        merged = contract_args(args, contract)
        identity = contract.business_identity or contract.identity
        business = {k: merged.get(k) for k in identity} if identity else merged
        if contract.idempotency_key_arg is not None and identity is None:
            business = {k: v for k, v in business.items() if k != contract.idempotency_key_arg}
        step.business_fp = fp.of_value(contract.name, business)
        if contract.idempotency_key_arg is not None:
            key = args.get(contract.idempotency_key_arg)
            if key not in (None, ""):
                step.idempotency_fp = fp.of_value("idempotency", key)


def fill_outcome(fp: Fingerprinter, step: Step, contract: ToolContract, result: Any) -> None:
    """The contract's fields the call's result gives: version, state, new items."""
    res = result if isinstance(result, dict) else {}
    if contract.version_field is not None:
        version = res.get(contract.version_field)
        if isinstance(version, int | float) and not isinstance(version, bool):
            step.version = float(version)
    if contract.state_field is not None:
        state = res.get(contract.state_field)
        if state is not None:
            step.state_fp = fp.of_value("state", state)
            step.state_terminal = str(state) in contract.terminal_states
    if contract.new_items_field is not None:
        items = res.get(contract.new_items_field)
        if isinstance(items, list):
            step.item_fps = tuple(fp.of_value("item", i)[:8] for i in items[:MAX_ITEMS])


def plan_fp(fp: Fingerprinter, policy: Policy, calls: list[tuple[str, Any]]) -> str | None:
    if not calls:
        return None
    normalized = [
        [tool, contract_args(a, policy.tool(tool)) if isinstance(a, dict) else a]
        for tool, a in calls
    ]
    return fp.of_value("plan", normalized)
