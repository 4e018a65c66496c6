"""The adapt report: `report.md` (tables, for people), `summary.json` (for programs and --against),
and `alignment.svg` (relative error after every operator of the small-scale run, log scale).

The Markdown is written for someone seeing the project for the first time: each section says in
one sentence what it checks and how to read it. The SVG is drawn by hand (no plotting library).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _b(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _n(x: int) -> str:
    return f"{x / 1e9:.1f} B" if x >= 1e9 else f"{x / 1e6:.1f} M"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return [*out, ""]


def render_markdown(s: dict, *, svg_name: str | None = None) -> str:
    """The report of one summary dict (see pipeline.summary)."""
    f = s["model_facts"]
    word = {"ready": "READY", "ready-generic": "READY (GENERIC PATH)"}.get(
        s["verdict"], "NEEDS WORK"
    )
    md = [f"# moectl adapt: {Path(s['model']).name}", ""]
    md += [f"**Verdict: {word}** for target `{s['target']}` "
           f"(`{s['model_type']}`, family `{s['family']}`).", ""]  # fmt: skip
    if s.get("runtime_cost"):
        md += [f"The model {s['runtime_cost']}.", ""]
    if s["reasons"]:
        md += ["Why it is not ready (each line names what must change):", ""]
        md += [f"- {r}" for r in s["reasons"]] + [""]
    else:
        md += ["Every operator is implemented and within tolerance, the shrunk model aligns with "
               "transformers layer by layer, and the plan fits.", ""]  # fmt: skip
    md += ["How to read this report: section 1 lists the operators of the model and what runs "
           "each one; 2 measures each implementation against a float64 reference; 3 runs a small "
           "model of the same family through our distributed runtime against transformers; 4 is "
           "the memory plan and parallel layout for the real size.", ""]  # fmt: skip
    md += ["## The model", ""]
    md += _table(["field", "value"], [
        ["layers (MoE)", f"{f['num_layers']} ({f['moe_layers']})"],
        ["hidden size / vocabulary", f"{f['hidden_size']} / {f['vocab_size']}"],
        ["routed experts, top-k", f"{f['num_experts']}, {f['top_k']}"],
        ["parameters total / active per token", f"{_n(f['total_params'])} / {_n(f['active_params'])}"],
        ["weights as stored", f"{_b(f['weight_bytes'])} ({f['quantization']})"],
        ["KV cache per token (bf16)", _b(f["kv_bytes_per_token"])],
        ["fixed state per sequence", _b(f["state_bytes_per_sequence"])],
        ["max context", str(f["max_context"])],
        ["runtime family", s["runtime_family"] or f"none ({s['runtime_error']})"],
    ])  # fmt: skip
    md += ["## 1. Operators", "",
           "Each operator of the model, how often it occurs, and the class of our runtime that "
           "implements it (none: the runtime cannot run it yet; the last column says what it needs).", ""]  # fmt: skip
    md += _table(["operator", "uses", "implementation", "needs"], [
        [o["name"], str(o["count"]), f"`{o['implementation']}`" if o["supported"] else "**none**",
         o["needs"] or ""] for o in s["operators"]
    ])  # fmt: skip
    md += ["## 2. Operator precision", "",
           "Our implementation run in float32 and float64 on random inputs of the model's real "
           "widths (or one tensor/expert-parallel rank's slice of them) against an independent "
           "float64 reference; the error is ||ours - ref|| / ||ref||.", ""]  # fmt: skip
    md += _table(["operator", "float32 err", "tol", "float64 err", "tol", "ok", "what ran"], [
        [c["operator"], _e(c["rel_err_fp32"]), f"{c['tolerance_fp32']:.0e}", _e(c["rel_err_fp64"]),
         f"{c['tolerance_fp64']:.0e}", "yes" if c["passed"] else "**NO**",
         c["ran"] + (f" ({c['note']})" if c["note"] else "")] for c in s["operator_checks"]
    ])  # fmt: skip
    md += _alignment_section(s, svg_name)
    md += _checkpoint_section(s)
    md += _plan_section(s)
    md += ["## Timings", ""]
    md += _table(["step", "seconds"], [[k, f"{v:.1f}"] for k, v in s["timings_s"].items()])
    return "\n".join(md)


def _alignment_section(s: dict, svg_name: str | None) -> list[str]:
    a = s["alignment"]
    md = ["## 3. Small-scale alignment", ""]
    if not a["ran"]:
        return [*md, f"Not run: {a['skipped']}.", ""]
    sc = a["shrunk_config"] or {}
    md += ["A shrunk model of the same family (same operators and routing, random weights, built "
           "by transformers' own class) runs through our runtime in each layout; every operator's "
           "output is compared with transformers' (relative error over all tokens of "
           f"{len(a['layouts'][0].get('seq_lens', []))} sequences).", ""]  # fmt: skip
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok",
            "n_group", "topk_group", "first_k_dense_replace")  # fmt: skip
    md += ["Shrunk config: " + ", ".join(f"{k}={sc[k]}" for k in keys if k in sc), ""]
    md += _table(["layout", "passed", "max rel err", "tolerance", "first divergence"], [
        [x["layout"], "yes" if x["passed"] else "**NO**", _e(x.get("max_rel_err")),
         f"{x.get('tolerance', 0):g}", (x.get("first_divergence") or {}).get("module", x.get("error", "-"))]
        for x in a["layouts"]
    ])  # fmt: skip
    if svg_name:
        md += [f"![relative error after each operator]({svg_name})", ""]
    first = next((x for x in a["layouts"] if x.get("layers")), None)
    if first is not None:
        md += [f"Per operator ({first['layout']}):", ""]
        md += _table(["layer", "op", "module", "rel err"], [
            ["-" if e["layer"] is None else str(e["layer"]), e["op"], e["module"], _e(e["rel_err"])]
            for e in first["layers"]
        ])  # fmt: skip
    return md


def _checkpoint_section(s: dict) -> list[str]:
    c = s["checkpoint"]
    if c is None:
        return [
            "## Checkpoint tensors",
            "",
            "Not checked: the input is a config without weights.",
            "",
        ]
    md = ["## Checkpoint tensors", "",
          f"{c['tensors']} tensors in the checkpoint; our loader maps {c['mapped']}." + (f" {c['note']}." if c.get("note") else ""), ""]  # fmt: skip
    if c["problems"]:
        md += _table(["tensor", "problem"], [[n, p] for n, p in c["problems"][:50]])
    return md


def _plan_section(s: dict) -> list[str]:
    t = s["topology"]
    md = ["## 4. Plan for the real size", "",
          f"Topology: `{t['name']}`, {t['source']}. Context planned for: {s['context']} tokens.", ""]  # fmt: skip
    p = s["plan"]
    if p is None:
        return [*md, f"No layout fits: {s['plan_error']}", ""]
    pred = p["predicted"]
    md += [f"Chosen layout **{p['layout']}** on {s['num_gpus']} GPUs (x {p['replicas']} replicas): "
           f"prefill {pred['prefill_ms']:.1f} ms, decode step {pred['decode_ms']:.2f} ms, KV for "
           f"{p['kv_capacity_tokens']} tokens ({p['max_sequences']} sequences at full context).", ""]  # fmt: skip
    md += ["Memory of one device per pipeline stage (static regions):", ""]
    md += _table(["stage", "HBM", "reserved", "weights", "activations", "workspace", "KV cache", "fits"], [
        [str(m["stage"]), _b(m["capacity"]), _b(m["reserved"]), _b(m["weights"]), _b(m["activations"]),
         _b(m["workspace"]), _b(m["kv_cache"]), "yes" if m["kv_cache"] >= 0 and m["max_sequences"] >= 1 else "**NO**"]
        for m in p["memory"]["stages"]
    ])  # fmt: skip
    if p["alternatives"]:
        md += ["Runners-up and why they lost:", ""]
        md += _table(["layout", "GPUs", "score", "why"], [
            [a["layout"], str(a["num_gpus"]), f"{a['score']:.2f}", a["why"]] for a in p["alternatives"]
        ])  # fmt: skip
    return md


def render_svg(s: dict, width: int = 720, height: int = 260) -> str | None:
    """Relative error after every operator of the first aligned layout, log10 scale, with the
    tolerance as a dashed line; None when no alignment ran."""
    layout = next((x for x in s["alignment"]["layouts"] if x.get("layers")), None)
    if layout is None:
        return None
    errs = [max(e["rel_err"], 1e-12) for e in layout["layers"]]
    tol = layout["tolerance"]
    lo = math.floor(min(math.log10(min(errs)), math.log10(tol)) - 0.5)
    hi = math.ceil(max(math.log10(max(errs)), math.log10(tol)) + 0.5)
    left, right, top, bottom = 60, 10, 20, 40
    pw, ph = width - left - right, height - top - bottom

    def y(v: float) -> float:
        return top + ph * (hi - math.log10(v)) / (hi - lo)

    step = pw / max(len(errs) - 1, 1)
    pts = " ".join(f"{left + i * step:.1f},{y(v):.1f}" for i, v in enumerate(errs))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="14">rel err after each operator, {layout["layout"]} (log scale)</text>',
             f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/>',
             f'<line x1="{left}" x2="{left + pw}" y1="{y(tol):.1f}" y2="{y(tol):.1f}" stroke="#d62728" stroke-dasharray="4 3"/>',
             f'<text x="{left + pw - 90}" y="{y(tol) - 4:.1f}" fill="#d62728">tolerance {tol:g}</text>',
             f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="black"/>']  # fmt: skip
    for k in range(lo, hi + 1):
        parts.append(f'<text x="4" y="{y(10.0**k) + 4:.1f}">1e{k}</text>')
    for i, e in enumerate(layout["layers"]):
        if e["op"] == "output" and e["layer"] is not None:
            parts.append(
                f'<text x="{left + i * step - 4:.1f}" y="{height - 22}">{e["layer"]}</text>'
            )
    parts.append(f'<text x="{left + pw / 2 - 20:.0f}" y="{height - 6}">layer</text></svg>')
    return "\n".join(parts)


def write_report(s: dict, out_dir: Path) -> list[Path]:
    """Write summary.json, report.md and (when alignment ran) alignment.svg into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "summary.json"]
    written[0].write_text(json.dumps(s, indent=1))
    svg = render_svg(s)
    if svg is not None:
        (out_dir / "alignment.svg").write_text(svg)
        written.append(out_dir / "alignment.svg")
    (out_dir / "report.md").write_text(
        render_markdown(s, svg_name="alignment.svg" if svg else None)
    )
    written.append(out_dir / "report.md")
    return written
