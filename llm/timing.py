"""A round's results on their way to the host (`Readback`), time per phase (`PhaseClock`) and what a
run did (`RunStats`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor


def to_host(*tensors) -> list[list]:
    """Tensors → host lists; device tensors with one synchronisation (a `Readback` hands its
    host copies, already complete, through here)."""
    if tensors[0].is_cuda:
        outs = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream().synchronize()
    else:
        outs = [t.cpu() for t in tensors]
    return [o.tolist() for o in outs]


class Readback:
    """One round's results on their way to the host, started as soon as the round is queued.

    On a GPU: non-blocking device → host copies into pinned buffers, queued on the current
    stream behind the round, and an event recorded after them; nothing waits until `wait()`.
    The copies are queued before the next round, so they read this round's outputs before the
    next round's graphs overwrite them (runners hand out the same output buffers again). On the
    CPU the copies are plain and complete at once (the same code path, `wait` does not block).
    """

    def __init__(self, *tensors: Tensor):
        cuda = tensors[0].is_cuda
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
                     .copy_(t, non_blocking=cuda) for t in tensors]
        self.event = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[list]:
        """The results as host lists: the loop's one host synchronisation per round."""
        if self.event is not None:
            self.event.synchronize()
        return to_host(*self.host)


class PhaseClock:
    """Time per phase of a loop: `mark(phase)` ends the interval since the previous mark and
    charges it to `phase`.

    On a GPU a mark records a CUDA event on the current stream and nothing waits for it: the
    intervals are the stream's timeline, so a phase includes any wait for the host to launch it
    and the phases of a run add up to its wall time. `totals()` reads them once the run has
    synchronised. On the CPU a mark reads perf_counter (the work is synchronous).

    The loop's "host" phase is the host waiting for the previous round's readback and processing
    it (emit, retire). With overlap the next round is already queued meanwhile: on the CPU the
    phase is that wait + processing in wall time; on a GPU it is the stream's time from the end
    of the queued round to the host's mark, i.e. the readback copies and row drops plus any time
    the GPU ran dry waiting for the host (near zero when the host keeps ahead).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._marks: list[tuple[str | None, object]] = []
        self.mark(None)

    def mark(self, phase: str | None) -> None:
        if self.cuda:
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter()
        self._marks.append((phase, stamp))

    def totals(self) -> dict[str, float]:
        """Seconds per phase, in order of first appearance (GPU: after a synchronisation)."""
        out: dict[str, float] = {}
        for (_, a), (phase, b) in zip(self._marks, self._marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[phase] = out.get(phase, 0.0) + dt
        return out


@dataclass
class RunStats:
    """What one `generate_*` run did.

    rounds counts the rounds (EAGLE) or decode steps (greedy) launched on the device. With
    overlap that includes a trailing round queued before the host knew every request had
    finished (every lane of it discarded), so with at most max_bs requests it is at most one
    more than without overlap (with continuous admission, rows freed one round late can delay
    the queued requests' start by a round each time);
    `round_seconds` divides the loop's time by it. accepted and request_rounds count only
    real request-rounds, whose results were emitted; discarded counts the lane-rounds whose
    results were thrown away (a request finished one round earlier, unforeseen: at most one
    per request that ran a round, with overlap; 0 without). overlap: whether this run was
    overlapped.
    """
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0            # verify rounds (EAGLE) or decode steps (greedy) launched
    accepted: int = 0          # accept lengths summed over real request-rounds (verify's count)
    emitted: int = 0           # tokens those request-rounds emitted (EOS / budget cut the last)
    request_rounds: int = 0    # real request-rounds, for the mean accept length
    discarded: int = 0         # lane-rounds run for an already finished request (overlap)
    overlap: bool = False
    prefills: int = 0          # prefill batches: 1, more with continuous admission
    phases: dict[str, float] = field(default_factory=dict)   # seconds: prefill, draft, verify,
    #                            draft_extend, host (EAGLE) or prefill, decode, host (greedy);
    #                            host: waiting for the previous readback + processing it

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accept_len(self) -> float:
        """Tokens the target accepted per request-round, bonus token included (draft quality)."""
        return self.accepted / self.request_rounds if self.request_rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens a request gained per round: accept_len less what EOS or the budget cut."""
        return self.emitted / self.request_rounds if self.request_rounds else 0.0

    @property
    def round_seconds(self) -> float:
        """Mean time of one round (EAGLE) or step (greedy): the phases after prefill."""
        loop = sum(t for name, t in self.phases.items() if name != "prefill")
        return loop / self.rounds if self.rounds else 0.0
