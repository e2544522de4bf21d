"""The capacity benchmark's report: one load level's figures from its requests, the table
printed under the machine header, the failures that fail the run and the notes beside them,
and the Markdown summary written beside the JSON."""

from __future__ import annotations

from pathlib import Path

from benchmarks.tts.harness import pct


def summarize(n: int, rows: list[dict], rounds: int, capacity: int | None, after: dict) -> dict:
    ok = [r for r in rows if r["outcome"] == "admitted"]
    refused = [r for r in rows if r["outcome"] == "refused"]
    other = [r for r in rows if r["outcome"] == "other_status"]
    errors = [r for r in rows if r["outcome"] == "error"]
    t, rtf = [r["ttfa_ms"] for r in ok], [r["rtf"] for r in ok]
    by_status: dict[str, int] = {}
    for r in other:
        by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
    retry = [float(r["retry_after"]) for r in refused if r["retry_after"] is not None]
    return dict(
        concurrency=n, rounds=rounds, offered=len(rows), admitted=len(ok),
        refused=len(refused), refused_429=sum(r["status"] == 429 for r in refused),
        refused_503=sum(r["status"] == 503 for r in refused),
        refused_with_retry_after=len(retry), refused_without_retry_after=len(refused) - len(retry),
        retry_after_s=[min(retry), max(retry)] if retry else None,
        other_status=by_status, other_5xx=sum(c for s, c in by_status.items() if int(s) >= 500),
        errors=len(errors), error_messages=sorted({r.get("error", "") for r in errors + other})[:5],
        underruns=sum(r["underruns"] for r in ok), underrun_s=round(sum(r["underrun_s"] for r in ok), 3),
        streams_with_underruns=sum(1 for r in ok if r["underruns"]),
        ttfa_n=len(t), ttfa_ms_p50=pct(t, 0.5) if t else None, ttfa_ms_p95=pct(t, 0.95) if t else None,
        rtf_p50=pct(rtf, 0.5) if rtf else None, rtf_max=max(rtf) if rtf else None,
        within_capacity=capacity is not None and n <= capacity,
        refused_within_capacity=capacity is not None and n <= capacity and len(refused) > 0,
        capacity_after=after.get("capacity_streams"), rtf_estimate_after=after.get("rtf_estimate"),
        realtime_after=after.get("realtime"), contention_after=after.get("contention"))



def fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def print_table(summaries: list[dict]) -> None:
    print(f"{'conc':>4} {'rnd':>3} | {'offer':>5} {'admit':>5} {'refused':>7} {'429':>4} {'503':>4} "
          f"{'R-A':>4} {'other':>5} {'err':>3} | {'underruns':>9} {'(s)':>6} | {'TTFA p50':>8} "
          f"{'p95':>6} {'n':>3} ms | {'RTF p50':>7} {'max':>5} | {'cap after':>9} {'RTF est':>7}")
    for s in summaries:
        other = sum(s["other_status"].values())
        print(f"{s['concurrency']:>4} {s['rounds']:>3} | {s['offered']:>5} {s['admitted']:>5} "
              f"{s['refused']:>7} {s['refused_429']:>4} {s['refused_503']:>4} "
              f"{s['refused_with_retry_after']:>4} {other:>5} {s['errors']:>3} | "
              f"{s['underruns']:>9} {s['underrun_s']:6.2f} | {fmt(s['ttfa_ms_p50'], '8.0f')} "
              f"{fmt(s['ttfa_ms_p95'], '6.0f')} {s['ttfa_n']:>3}    | {fmt(s['rtf_p50'], '7.2f')} "
              f"{fmt(s['rtf_max'], '5.2f')} | {str(s['capacity_after']):>9} "
              f"{fmt(s['rtf_estimate_after'], '7.3f')}")
    print("(R-A: refusals that carried a Retry-After header; other: any status but 200/429/503; "
          "err: transport errors and broken streams)")


def run_failures(summaries: list[dict]) -> list[str]:
    """What fails the run: a 5xx other than a 503 refusal, any other unexpected status, a
    transport error or broken stream, a refusal without Retry-After."""
    loud = []
    for s in summaries:
        if s["other_5xx"]:
            loud.append(f"concurrency {s['concurrency']}: {s['other_5xx']} responses with a 5xx "
                        f"status other than a 503 refusal: {s['other_status']} "
                        f"{s['error_messages']}")
        elif s["other_status"]:
            loud.append(f"concurrency {s['concurrency']}: unexpected statuses {s['other_status']} "
                        f"{s['error_messages']}")
        if s["errors"]:
            loud.append(f"concurrency {s['concurrency']}: {s['errors']} transport errors or broken "
                        f"streams: {s['error_messages']}")
        if s["refused_without_retry_after"]:
            loud.append(f"concurrency {s['concurrency']}: {s['refused_without_retry_after']} "
                        "refusals without a Retry-After header")
    return loud


def run_notes(summaries: list[dict], cap: int | None, not_idle: list[int]) -> list[str]:
    """Worth reading but not a failure: refusals or underruns at or below the capacity, and
    levels after which the server was still busy."""
    out = []
    for s in summaries:
        if s["refused_within_capacity"]:
            out.append(f"concurrency {s['concurrency']} <= capacity {cap}: {s['refused']} "
                       "refused")
        if s["within_capacity"] and s["underruns"]:
            out.append(f"concurrency {s['concurrency']} <= capacity {cap}: {s['underruns']} "
                       f"underruns in {s['streams_with_underruns']} admitted streams")
    if not_idle:
        out.append(f"the server still ran streams 10 s after a round (levels {sorted(set(not_idle))})")
    return out


def write_md(path: Path, doc: dict) -> None:
    """A Markdown summary of the run beside its JSON."""
    m, h = doc["machine"], doc["health"]
    out = [f"# capacity_bench: {doc.get('label') or Path(doc['model']).name}", "",
           f"Machine: {m.get('label')} (1 thread {m.get('bandwidth_gbs_1_thread')} GB/s; load "
           f"average at start {m.get('load_avg_at_start')}; measured {m.get('measured_at')}).",
           f"Server: `omni-stream serve --model {doc['model']} {doc['server_args']}`; /health at "
           f"start: capacity {h.get('capacity_streams')}, RTF estimate {h.get('rtf_estimate')}, "
           f"bandwidth {h.get('bandwidth_gbs')} GB/s, slots {h.get('slots')}.",
           f"Command: `{doc['command']}`", ""]
    st = doc.get("steady")
    if st:
        c = st["checks"]
        out += ["## Steady load at capacity", "",
                f"{c['clients']} client(s), each sending its next {doc['frames']}-frame request "
                f"as soon as the previous ended, for {st['seconds']:g} s; other processes used "
                f"{st['others_cores']:.2f} cores on average meanwhile.", "",
                "| check | result | figures |", "|---|---|---|",
                f"| capacity at start == after {st['seconds']:g} s | "
                f"{'PASS' if c['capacity_held'] else 'FAIL'} | {c['capacity_at_start']} -> "
                f"{c['capacity_after']} (lowest {c['capacity_min']}) |",
                f"| every admitted stream gap-free | {'PASS' if c['gap_free'] else 'FAIL'} | "
                f"{c['underruns']} underruns in {c['streams']} streams, {c['refused']} refused |",
                f"| TTFA <= 2 x single-stream | {'PASS' if c['ttfa_within'] else 'FAIL'} | max "
                f"{fmt(c['ttfa_ms_max'], '.0f')} ms, p95 {fmt(c['ttfa_ms_p95'], '.0f')}; single "
                f"p50 {fmt(c['ttfa_single_ms_p50'], '.0f')} ms |", ""]
    if doc["summaries"]:
        out += ["## Load levels", "", "| clients | offered | admitted | refused | underruns "
                "| TTFA p50 ms | p95 | RTF p50 | capacity after |", "|---" * 9 + "|"]
        for s in doc["summaries"]:
            out.append(f"| {s['concurrency']} | {s['offered']} | {s['admitted']} | "
                       f"{s['refused']} | {s['underruns']} | {fmt(s['ttfa_ms_p50'], '.0f')} | "
                       f"{fmt(s['ttfa_ms_p95'], '.0f')} | {fmt(s['rtf_p50'], '.2f')} | "
                       f"{s['capacity_after']} |")
        out.append("")
    if doc["failures"] or doc["notes"]:
        out += ["## Notes", ""] + [f"- {x}" for x in doc["failures"] + doc["notes"]] + [""]
    path.write_text("\n".join(out))
