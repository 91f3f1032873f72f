"""What the terminal shows during a sweep: one live progress line per running point (plain lines
when stdout is not a terminal, e.g. in CI logs) and one summary line per finished point."""
from __future__ import annotations

import sys
import time

from ablate import results

PLAIN_EVERY_S = 10.0  # without a terminal, a progress line at most this often


def _fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _overhead(timing: dict) -> str:
    """'  overhead 31.2 of 36.0 s': the point's wall time outside its measured steps (start-up,
    build, warm-up, trace, eval, teardown), where the phases were timed."""
    wall, measured = timing.get("wall_s"), (timing.get("phases_s") or {}).get("measured")
    return f"  overhead {wall - measured:.1f} of {wall:.1f} s" if wall is not None and measured is not None else ""


class Progress:
    def __init__(self, label: str, stream=sys.stdout):
        self.label, self.stream = label, stream
        self.tty = stream.isatty()
        self._last_plain = 0.0
        self._live = False

    def __call__(self, event: dict) -> None:
        if event["event"] == "phase":  # eval gets a line of its own: it can outlast a short run's training
            self._show(f"{self.label}  {event['phase']}...", force=event["phase"] in ("init", "eval"))
        elif event["event"] == "progress":
            loss = event.get("loss")  # null: the events channel's NaN or inf (a progress line always has a loss)
            self._show(f"{self.label}  step {event['step']}/{event['steps']}  loss "
                       f"{'non-finite' if loss is None else f'{loss:.4f}'}"
                       f"  {event['elapsed_s']:.1f}s", force=event["step"] == event["steps"])

    def _show(self, line: str, force: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self._live = True
        elif force or time.monotonic() - self._last_plain >= PLAIN_EVERY_S:
            self.stream.write(line + "\n")
            self._last_plain = time.monotonic()
        self.stream.flush()

    def note(self, line: str) -> None:
        """A line of its own (a waiting point, a result file found wanting), under any live line."""
        if self._live:
            self.stream.write("\r\033[K")
            self._live = False
        self.stream.write(f"{self.label}  {line}\n")
        self.stream.flush()

    def done(self, result: dict, where: str, skipped: bool = False) -> None:
        if self._live:
            self.stream.write("\r\033[K")
        m = result["metrics"]
        status = "skip" if skipped else result["status"]
        predicted = (result.get("prediction") or {}).get("peak_mib")
        if result["status"] in results.MEASURED:  # a diverged run measured its peak and time too
            peak = m["peak_allocated_mib"]
            error = f", {100 * (predicted / peak - 1):+.1f}%" if predicted and peak else ""  # the model's own check
            detail = (f"peak {_fmt(peak, '.1f', ' MiB')} (predicted {_fmt(predicted, '.1f')}{error})"
                      f"  iter {_fmt(m['iter_time_ms'], '.1f', ' ms')}"
                      f"  {_fmt(m['tokens_per_s'], ',.0f', ' tok/s')}  loss {_fmt(m['loss_final'], '.4f')}"
                      + _overhead(result.get("timing") or {}))
            if m.get("traced_step_oom"):  # the eager traced step ran out of memory; the measured steps fit
                detail += "  (traced step: OOM, no breakdown)"
            if result["reason"]:  # diverged: where the loss went non-finite
                detail += f"  {result['reason']}"
        elif result["status"] == "predicted":
            detail = f"predicted peak {_fmt(predicted, ',.1f', ' MiB')}"
            if result["reason"]:  # e.g. what a predicted batch search could not answer
                detail += f" ({result['reason']})"
        else:
            detail = f"{result['status']}: {result['reason']}"
        if m.get("max_batch_size"):  # find_batch's answer, measured or predicted
            guess = f" (predicted {m['predicted_max_batch_size']})" if m.get("predicted_max_batch_size") else ""
            detail = f"max micro-batch {m['max_batch_size']}{guess}  " + detail
        if m.get("max_seq_len"):  # find_seq's answer, measured or predicted
            guess = f" (predicted {m['predicted_max_seq_len']})" if m.get("predicted_max_seq_len") else ""
            detail = f"longest seq_len {m['max_seq_len']}{guess}  " + detail
        if skipped:  # what to type when the earlier row is not wanted
            detail += "  (found done; skip_existing=false runs it again)"
        self.stream.write(f"[{status:>7}] {self.label}  {detail}  -> {where}\n")
        self.stream.flush()
