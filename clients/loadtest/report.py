"""The results of a run: the table, the JSON file, the PNG plot, the HTML report and the comparison with a
baseline."""

from __future__ import annotations

import base64
import importlib.util
import html
import json
import math
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from convserve.clients.loadtest.stats import CONTROL_KINDS, CONV_KINDS, FRONTEND_KINDS

KIND_COLORS = {"prefill": "tab:blue", "decode": "tab:orange", "verify": "tab:green", "batch": "tab:purple",
               "step": "tab:red", "prefill_done": "tab:brown", "all": "tab:gray"}


def _ms(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _codes(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"


def _tokens_cell(kind: str, d: dict) -> str:
    if kind == "step" and d.get("accepted_tokens_per_s") is not None and d["accepted_tokens"] != d["tokens"]:
        return f"{d['tokens_per_s']:.0f} ({d['accepted_tokens_per_s']:.0f} accepted)"   # drafted verify tokens
    return f"{d['tokens_per_s']:.0f}" if kind in CONV_KINDS or kind == "step" else ""


def table_rows(result: dict) -> list:
    """Rows ``[step, kind, requests, req/s, tokens/s, MB/s, p50, p90, p99, max, errors, retries]`` (strings)."""
    rows = []
    for st in result["steps"]:
        ctl_errors = st.get("control_errors") or {}
        kinds = [k for k in (*CONV_KINDS, *FRONTEND_KINDS, *CONTROL_KINDS) if k in st["kinds"] or k in ctl_errors]
        first = True
        for k in kinds:
            d = st["kinds"].get(k) or {"count": 0, "req_per_s": 0.0, "tokens_per_s": 0.0, "p50_ms": None,
                                       "p90_ms": None, "p99_ms": None, "max_ms": None}
            # a control call's errors are on its own row (create, delete, accept), not among the conv errors
            rows.append([st["label"] if first else "", k, str(d["count"]), f"{d['req_per_s']:.1f}",
                         _tokens_cell(k, d), "",
                         _ms(d["p50_ms"]), _ms(d["p90_ms"]), _ms(d["p99_ms"]), _ms(d["max_ms"]),
                         _codes(ctl_errors[k]) if k in ctl_errors else "", ""])
            first = False
        lat = st["latency"]
        rows.append([st["label"] if first else "", "all conv", str(st["requests"]), f"{st['req_per_s']:.1f}",
                     f"{st['tokens_per_s']:.0f}", f"{st['mb_per_s']:.2f}", _ms(lat["p50_ms"]), _ms(lat["p90_ms"]),
                     _ms(lat["p99_ms"]), _ms(lat["max_ms"]), _codes(st["errors"]), _codes(st["retries"])])
    return rows


HEADERS = ["step", "kind", "requests", "req/s", "tokens/s", "MB/s", "p50 ms", "p90 ms", "p99 ms", "max ms",
           "errors", "retries"]


def chunk_words(cfg: dict) -> str:
    """``", chunk 512 (server max_tokens_per_request)"``: the prefill chunk the run used and why (empty for a
    result that does not say)."""
    c = cfg.get("prefill_chunk")
    return f", chunk {c['tokens']} ({c['why']})" if c else ""


def print_table(result: dict, console: Optional[Console] = None) -> None:
    console = console or Console()
    cfg = result["config"]
    t = Table(title=f"convserve load test: {cfg['workload']['scenario']} over {cfg['transport']} "
                    f"against {cfg['url']}{chunk_words(cfg)}", show_lines=False)
    for h in HEADERS:
        t.add_column(h, justify="left" if h in ("step", "kind", "errors", "retries") else "right")
    for st_i, row in enumerate(table_rows(result)):
        t.add_row(*row, end_section=row[1] == "all conv")
    console.print(t)
    for st in result["steps"]:
        for line in step_notes(st, cfg):
            console.print(line, markup=False, highlight=False)
        v = st["verify"]
        if v["checked"] or v["mismatches"]:
            console.print(f"{st['label']}: verified {v['checked']} answers against the reference, "
                          f"{v['mismatches']} mismatch(es) (an answer: one session's y, a unary call's or its "
                          "slice of a batch)")
        elif cfg.get("verify"):            # asked for, but no sampled session answered: say so, not silence
            console.print(f"{st['label']}: verified 0 answers: no sampled session (--verify-sample "
                          f"{cfg.get('verify_sample')}) got an answer in this step; raise --verify-sample, run "
                          "longer, or lower --warmup (a request in the warm-up is not verified)")


def step_notes(st: dict, cfg: dict) -> list:
    """Lines under the table for one step: what the errors said, work cut off at the step's end, an interrupt."""
    out = []
    for code, msg in (st.get("error_messages") or {}).items():
        out.append(f"{st['label']}: {code}: {msg}")
    c = st.get("cut_off") or {}
    if c.get("tasks_cancelled") or c.get("sessions_deleted") or c.get("sessions_not_deleted"):
        why = "the interrupt" if st.get("interrupted") else f"--grace {cfg.get('grace_s', '?')} s"
        out.append(f"{st['label']}: {c.get('tasks_cancelled', 0)} virtual session(s) / arrival(s) still running "
                   f"were cancelled at {why}; {c.get('sessions_deleted', 0)} session(s) left on the server deleted"
                   + (f", {c['sessions_not_deleted']} could not be confirmed deleted" if c.get("sessions_not_deleted")
                      else ""))
    by_why: dict = {}
    for sid, reason in (c.get("not_deleted") or {}).items():
        by_why.setdefault(reason, []).append(sid)
    for reason, sids in by_why.items():         # every id: an operator must be able to delete them
        out.append(f"{st['label']}: {len(sids)} session(s) may still hold a slot on the server ({reason}): "
                   + ", ".join(sids))
    if st.get("prefill_steps"):             # (frontend) the step row mixes them with the decode steps
        steps = (st.get("kinds") or {}).get("step", {}).get("count", "?")
        out.append(f"{st['label']}: {st['prefill_steps']} of the {steps} measured steps carried prefill rows "
                   f"({st['prefill_tokens']} tokens): sessions prefilled after the warm-up (a ramp longer than "
                   f"--warmup {cfg.get('warmup_s', '?')} s, or arrivals); their latency is in the step row: raise "
                   "--warmup to measure decode steps alone")
    if st.get("interrupted"):
        out.append(f"{st['label']}: interrupted: the figures cover the step up to the interrupt")
    return out


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=2, default=_json_default))


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def plot_png(result: dict, path: Path) -> None:
    """Latency (p50 dashed, p99 solid) against throughput across the sweep, one colour per kind (the frontend's
    ``step`` and ``prefill_done`` too, against the same conv throughput); points are labelled by step on the
    decode / verify lines, or on the only line there is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    steps = result["steps"]
    plotted = [k for k in (*CONV_KINDS, *FRONTEND_KINDS) if any(k in st["kinds"] for st in steps)]
    for kind in (*CONV_KINDS, *FRONTEND_KINDS, "all"):
        pts = []
        for st in steps:
            d = st["latency"] if kind == "all" else st["kinds"].get(kind)
            if d is None or d.get("p99_ms") is None:
                continue
            pts.append((st["req_per_s"], d["p50_ms"], d["p99_ms"], st["label"]))
        if not pts or (kind == "all" and sum(k in steps[0]["kinds"] for k in CONV_KINDS) <= 1):
            continue
        xs = [p[0] for p in pts]
        c = KIND_COLORS[kind]
        ax.plot(xs, [p[2] for p in pts], "-o", color=c, label=f"{kind} p99")
        ax.plot(xs, [p[1] for p in pts], "--", marker=".", color=c, label=f"{kind} p50")
        if kind in ("decode", "verify", "step") or len(plotted) == 1:
            for x, _, y, lab in pts:
                ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    cfg = result["config"]
    ax.set_xlabel("throughput (conv requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{cfg['workload']['scenario']} over {cfg['transport']} ({cfg['mode']} loop)", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no request answered", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_html(result: dict, png_path: Optional[Path], path: Path) -> None:
    """The report page; without a plot (``png_path`` None) it says how to get one."""
    if png_path is not None:
        img = base64.b64encode(png_path.read_bytes()).decode("ascii")
        figure = f'<img alt="latency against throughput" src="data:image/png;base64,{img}">'
    else:
        figure = "<p>No plot: install <code>convserve[loadtest]</code> (matplotlib) for it.</p>"
    cfg = result["config"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    body = []
    for row in table_rows(result):
        cls = ' class="total"' if row[1] == "all conv" else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
    model = cfg.get("model", {})
    notes = [n for st in result["steps"] for n in step_notes(st, cfg)]
    notes_html = ("<h2>Notes</h2>\n<pre>" + html.escape("\n".join(notes)) + "</pre>") if notes else ""
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>convserve load test</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:nth-child(1), td:nth-child(2), td:nth-child(11), td:nth-child(12) {{ text-align: left; }}
tr.total {{ font-weight: bold; background: #f4f4f4; }}
pre {{ background: #f8f8f8; padding: 1em; font-size: 12px; }}
</style></head><body>
<h1>convserve load test</h1>
<p>{html.escape(cfg['workload']['scenario'])} over {html.escape(cfg['transport'])}, {html.escape(cfg['mode'])} loop,
against {html.escape(cfg['url'])} (model: layers {html.escape(str(model.get('layers')))}, dim
{html.escape(str(model.get('dim')))}, {html.escape(str(model.get('dtype')))}){html.escape(chunk_words(cfg))};
{html.escape(cfg['started'])}.</p>
{figure}
<h2>Per step</h2>
<table><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(body)}
</tbody></table>
{notes_html}
<h2>Run configuration</h2>
<pre>{html.escape(json.dumps(cfg, indent=2, default=str))}</pre>
</body></html>
"""
    path.write_text(doc)


def write_outputs(result: dict, out_dir: Path) -> dict:
    """Write loadtest.json, loadtest.png (when matplotlib, the ``loadtest`` extra, is installed) and
    loadtest.html; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "loadtest.json", "png": out_dir / "loadtest.png", "html": out_dir / "loadtest.html"}
    write_json(result, paths["json"])
    if importlib.util.find_spec("matplotlib") is not None:
        plot_png(result, paths["png"])
    else:
        del paths["png"]
    write_html(result, paths.get("png"), paths["html"])
    return paths


# --------------------------------------------------------------------------------------------- compare

#: config fields that define what a run measured: a baseline that differs in one is not comparable
_HARD = ("mode", "transport", "workload", "inflight", "connections", "max_inflight")
_MODEL = ("layers", "dim", "width", "dtype", "state_dtype")
#: fields that change how long or how it was measured: reported, not refused
_SOFT = ("duration_s", "requests", "warmup_s", "verify", "seed")


def config_differences(config: dict, base: dict) -> tuple[list, list]:
    """``(hard, soft)``: descriptions of the run-defining (hard) and measurement (soft) settings in which
    ``config`` differs from the baseline's ``base`` (fields a baseline lacks are not compared)."""
    def diff(names, a, b, prefix=""):
        return [f"{prefix}{n}: baseline {b[n]!r}, this run {a.get(n)!r}" for n in names
                if n in b and a.get(n) != b[n]]

    hard = diff(_HARD, config, base)
    hard += diff(_MODEL, config.get("model") or {}, base.get("model") or {}, "model ")
    return hard, diff(_SOFT, config, base)



class CompareError(ValueError):
    pass


def _pct(new, old) -> Optional[float]:
    if new is None or old is None or old == 0:
        return None
    return (new - old) / old * 100.0


def compare(result: dict, baseline: dict, regress_pct: float) -> tuple[list, list]:
    """``(rows, regressions)``: one row per matched step and figure; a regression is a throughput drop or a
    p99 rise of more than ``regress_pct`` percent."""
    base = {st["label"]: st for st in baseline.get("steps", [])}
    rows, bad = [], []
    matched = 0
    for st in result["steps"]:
        b = base.get(st["label"])
        if b is None:
            continue
        matched += 1
        figs = [("req/s", st["req_per_s"], b["req_per_s"], "higher"),
                ("tokens/s", st["tokens_per_s"], b["tokens_per_s"], "higher"),
                ("p99 ms (all conv)", st["latency"]["p99_ms"], b["latency"]["p99_ms"], "lower")]
        for kind in CONV_KINDS:
            if kind in st["kinds"] and kind in b.get("kinds", {}):
                figs.append((f"p99 ms ({kind})", st["kinds"][kind]["p99_ms"], b["kinds"][kind]["p99_ms"], "lower"))
        for name, new, old, better in figs:
            ch = _pct(new, old)
            worse = ch is not None and ((better == "higher" and ch < -regress_pct) or
                                        (better == "lower" and ch > regress_pct))
            if name == "tokens/s":
                worse = False  # follows req/s; reported, not gated
            rows.append((st["label"], name, old, new, ch, worse))
            if worse:
                bad.append(f"{st['label']} {name}: {old:.3g} -> {new:.3g} ({ch:+.1f}%)")
    if matched == 0:
        raise CompareError("no step of this run matches a step of the baseline (steps are matched by label, e.g. "
                           f"'c=8' or 'rate=100'); baseline steps: {sorted(base)}, this run: "
                           f"{[s['label'] for s in result['steps']]}")
    return rows, bad


def print_compare(rows: list, bad: list, regress_pct: float, baseline_path: str,
                  console: Optional[Console] = None) -> None:
    console = console or Console()
    t = Table(title=f"change against {baseline_path} (regression threshold {regress_pct:g}%)")
    for h in ("step", "figure", "baseline", "now", "change", ""):
        t.add_column(h, justify="left" if h in ("step", "figure", "") else "right")
    for label, name, old, new, ch, worse in rows:
        t.add_row(label, name, f"{old:.3g}" if old is not None else "-", f"{new:.3g}" if new is not None else "-",
                  f"{ch:+.1f}%" if ch is not None else "-", "[red]REGRESSION[/red]" if worse else "")
    console.print(t)
    if bad:
        console.print(f"[red]{len(bad)} regression(s) past {regress_pct:g}%:[/red] " + "; ".join(bad))
    else:
        console.print(f"no regression past {regress_pct:g}%")
