"""`moectl adapt --against PREVIOUS.json`: what changed between two versions of a model.

Both sides are adapt summaries (pipeline.summary). A change is one of: config (layers, experts,
top-k, widths, context), operator (new, gone, count, support), tensor (new, gone, shape),
memory (weights, KV per token, per-device regions, more than 1%), plan (layout, fits), precision
(an operator's or the alignment's error moved by more than 10x or crossed its tolerance) and
verdict. Severity `regression` marks what makes the new version worse (the verdict leaves ready,
an error crosses its tolerance, the plan stops fitting); everything else is `change`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cluster.errors import InputError

_REL_MEMORY = 0.01
_ERR_FACTOR = 10.0


@dataclass(frozen=True, kw_only=True)
class Change:
    kind: str
    subject: str
    before: object
    after: object
    severity: str = "change"

    def __str__(self) -> str:
        return f"{self.severity}: {self.kind} {self.subject}: {self.before} -> {self.after}"


def check_summary(data: object, label: str) -> dict:
    """InputError unless `data` looks like an adapt summary."""
    need = ("verdict", "model_facts", "operators", "tensors")
    if not isinstance(data, dict) or any(k not in data for k in need):
        raise InputError(
            f"--against {label}: not a moectl adapt summary.json (needs {', '.join(need)})"
        )
    return data


def compare(before: dict, after: dict) -> list[Change]:
    """Every change from `before` to `after`, config first, verdict last."""
    out: list[Change] = []
    # Step 1: config facts.
    for key, b in before["model_facts"].items():
        a = after["model_facts"].get(key)
        if key in ("weight_bytes", "kv_bytes_per_token", "state_bytes_per_sequence"):
            if _moved(b, a):
                out.append(Change(kind="memory", subject=key, before=b, after=a))
        elif a != b:
            out.append(Change(kind="config", subject=key, before=b, after=a))
    # Step 2: operators.
    ob = {o["name"]: o for o in before["operators"]}
    oa = {o["name"]: o for o in after["operators"]}
    for name in sorted(set(ob) | set(oa)):
        b, a = ob.get(name), oa.get(name)
        if b is None:
            out.append(Change(kind="operator", subject=name, before="absent",
                              after=f"new ({a['count']} uses, {'supported' if a['supported'] else 'unsupported'})",
                              severity="change" if a["supported"] else "regression"))  # fmt: skip
        elif a is None:
            out.append(
                Change(kind="operator", subject=name, before=f"{b['count']} uses", after="gone")
            )
        else:
            if a["count"] != b["count"]:
                out.append(
                    Change(
                        kind="operator", subject=f"{name} uses", before=b["count"], after=a["count"]
                    )
                )
            if a["supported"] != b["supported"]:
                out.append(Change(kind="operator", subject=f"{name} supported", before=b["supported"],
                                  after=a["supported"], severity="regression" if b["supported"] else "change"))  # fmt: skip
    # Step 3: tensors (name patterns with the layer index as {i}).
    tb, ta = before["tensors"], after["tensors"]
    for name in sorted(set(tb) | set(ta)):
        b, a = tb.get(name), ta.get(name)
        if b != a:
            out.append(Change(kind="tensor", subject=name, before=_shapes(b), after=_shapes(a)))
    # Step 4: plan and per-device memory.
    out += _plan_changes(before, after)
    # Step 5: precision.
    cb = {c["operator"]: c for c in before.get("operator_checks", [])}
    for c in after.get("operator_checks", []):
        p = cb.get(c["operator"])
        if p is not None:
            out += _err_change(
                f"operator {c['operator']}",
                p["rel_err_fp32"],
                c["rel_err_fp32"],
                c["tolerance_fp32"],
            )
    tol = next(
        (x.get("tolerance") for x in after["alignment"]["layouts"] if "tolerance" in x), 1e-4
    )
    out += _err_change(
        "alignment max",
        before.get("alignment_max_rel_err"),
        after.get("alignment_max_rel_err"),
        tol,
    )
    if before["verdict"] != after["verdict"]:
        out.append(Change(kind="verdict", subject="", before=before["verdict"], after=after["verdict"],
                          severity="regression" if before["verdict"] == "ready" else "change"))  # fmt: skip
    return out


def _moved(b, a) -> bool:
    if b is None or a is None:
        return b != a
    return abs(a - b) > _REL_MEMORY * max(abs(b), 1)


def _shapes(entry) -> str:
    if entry is None:
        return "absent"
    return "; ".join(f"{s} x{c} ({n} layers)" if c > 1 else f"{s} ({n})" for s, c, n in entry)


def _plan_changes(before: dict, after: dict) -> list[Change]:
    pb, pa = before.get("plan"), after.get("plan")
    if pb is None and pa is None:
        return []
    if pb is None or pa is None:
        return [Change(kind="plan", subject="fits", before=pb is not None, after=pa is not None,
                       severity="regression" if pa is None else "change")]  # fmt: skip
    out = []
    if pb["layout"] != pa["layout"]:
        out.append(Change(kind="plan", subject="layout", before=pb["layout"], after=pa["layout"]))
    mb, ma = pb["memory"], pa["memory"]
    for key in ("weights", "activations", "workspace", "kv_cache"):
        if _moved(mb.get(key), ma.get(key)):
            out.append(
                Change(
                    kind="memory", subject=f"device {key}", before=mb.get(key), after=ma.get(key)
                )
            )
    return out


def _err_change(subject: str, b: float | None, a: float | None, tol: float) -> list[Change]:
    if b is None or a is None:
        return [] if b == a else [Change(kind="precision", subject=subject, before=b, after=a)]
    crossed = b <= tol < a
    moved = max(a, 1e-300) / max(b, 1e-300)
    if crossed or moved > _ERR_FACTOR or moved < 1 / _ERR_FACTOR:
        return [Change(kind="precision", subject=subject, before=f"{b:.2e}", after=f"{a:.2e}",
                       severity="regression" if crossed else "change")]  # fmt: skip
    return []


def to_json(changes: list[Change]) -> list[dict]:
    return [asdict(c) for c in changes]
