"""Encode's clip windows: `decode_frames` (seek to the keyframe at or before the window, decode
forward, stop past it) against decoding every window from the clip's first frame, as encode did
before, over consecutive windows of one generated clip (640x360, 30 fps, 10 s), with a keyframe
every second and at x264's default interval, in alternating rounds (each window's fastest kept).
Both return the same pixels (checked).

    python -m benchmarks --only clip_windows
"""
from __future__ import annotations

import time
from pathlib import Path

SIZE, FPS, SECONDS, WINDOW, WINDOWS, ROUNDS = (640, 360), 30, 10, 33, 9, 3
KEYFRAMES = {"every_second": FPS, "x264_default": None}


def write_long_clip(path: Path, keyframe_every: int | None) -> Path:
    """Noise sliding sideways, lossy yuv420p as a camera writes it, one encoder thread."""
    import av
    import numpy as np

    if path.exists():
        return path
    noise = np.random.default_rng(0).integers(0, 255, (SIZE[1], SIZE[0], 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = *SIZE, "yuv420p"
        stream.options = {"crf": "23", "threads": "1"}
        if keyframe_every:
            stream.codec_context.gop_size = keyframe_every
        for k in range(FPS * SECONDS):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.roll(noise, 4 * k, axis=1), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def from_first_frame(path: Path, indices: list[int]):
    """The window's frames decoded from the clip's start (every frame before it decoded too)."""
    import av
    import numpy as np

    wanted, found = set(indices), {}
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "NONE"
        for n, frame in enumerate(container.decode(stream)):
            if n in wanted:
                found[n] = frame.to_ndarray(format="rgb24")
                if len(found) == len(wanted):
                    break
    return np.stack([found[i] for i in indices])


def window_times(path: Path, decode) -> tuple[list[float], list]:
    step = (FPS * SECONDS - WINDOW) // (WINDOWS - 1)
    seconds, frames = [], []
    for w in range(WINDOWS):
        started = time.perf_counter()
        frames.append(decode(path, list(range(w * step, w * step + WINDOW))))
        seconds.append(time.perf_counter() - started)
    return seconds, frames


def measure(root: Path) -> dict:
    import numpy as np

    from lorapipe.stages.video import decode_frames

    results = {"clip": f"{SIZE[0]}x{SIZE[1]}, {FPS} fps, {SECONDS} s", "windows": f"{WINDOWS} x {WINDOW} frames"}
    for name, keyframe_every in KEYFRAMES.items():
        clip = write_long_clip(root / f"long-clip-{name}.mp4", keyframe_every)
        rounds = [(window_times(clip, decode_frames), window_times(clip, from_first_frame)) for _ in range(ROUNDS)]
        (_, seek_frames), (_, start_frames) = rounds[0]
        seek_s = [min(times) for times in zip(*(seek[0] for seek, _ in rounds))]
        start_s = [min(times) for times in zip(*(start[0] for _, start in rounds))]
        results[name] = {
            "same_pixels": all(np.array_equal(a, b) for a, b in zip(seek_frames, start_frames)),
            "seek_total_s": round(sum(seek_s), 2), "from_start_total_s": round(sum(start_s), 2),
            "from_start_over_seek": round(sum(start_s) / sum(seek_s), 2),
            "last_over_first_window_seek": round(seek_s[-1] / seek_s[0], 2),
            "last_over_first_window_from_start": round(start_s[-1] / start_s[0], 2),
        }
    return results
