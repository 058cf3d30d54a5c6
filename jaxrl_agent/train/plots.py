"""PNG pictures of a run: the learning curve and the per-turn credit of a few trajectories.

Headless and free of global state: figures are ``matplotlib.figure.Figure`` objects drawn with
the Agg canvas (no ``pyplot``, no backend switch). Missing data never raises: an empty panel
says "no data".
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["learning_curve", "credit_picture"]

_DPI = 120
_MAX_TRAJECTORIES = 6
_LABEL_CHARS = 12
_TRAIN_COLOR = "tab:blue"
_EVAL_COLOR = "tab:orange"


# ----------------------------------------------------------------------------- helpers


def _series(rows, key) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that have a finite number under ``key``, sorted by step."""
    pts = []
    for row in rows:
        v, step = row.get(key), row.get("step")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or step is None:
            continue
        if math.isfinite(v):
            pts.append((step, float(v)))
    pts.sort(key=lambda p: p[0])
    if not pts:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pts)
    return np.asarray(steps, float), np.asarray(values, float)


def _smooth(values: np.ndarray, fraction: float = 0.05) -> np.ndarray:
    """Centered moving average over ~``fraction`` of the points (shrinking at the ends)."""
    n = len(values)
    half = max(0, int(round(fraction * n)) // 2)
    if half == 0:
        return values
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(n)
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, n)
    return (csum[hi] - csum[lo]) / (hi - lo)


def _no_data(ax, text="no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes,
            color="gray", fontsize=12)


def _save(fig: Figure, path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI, format="png")
    return path


def _short(text, n=_LABEL_CHARS) -> str:
    """One line of at most ``n`` characters, with ``$`` escaped: a policy's text (an untrained
    model's bytes) is shown as written, never parsed as matplotlib mathtext."""
    text = " ".join(str(text).split())  # one line
    text = text if len(text) <= n else text[: n - 1] + "\u2026"
    return text.replace("$", r"\$")


# ----------------------------------------------------------------------------- learning curve


def _curve_panel(ax, rows, train_key, eval_key, ylabel, unit_range=False) -> None:
    drawn = False
    steps, values = _series(rows, train_key)
    if len(steps):
        ax.plot(steps, values, color=_TRAIN_COLOR, alpha=0.3, linewidth=1)
        ax.plot(steps, _smooth(values), color=_TRAIN_COLOR, linewidth=2, label="train")
        drawn = True
    steps, values = _series(rows, eval_key)
    if len(steps):
        ax.plot(steps, values, color=_EVAL_COLOR, marker="o", markersize=4, linewidth=1.5,
                label="held-out")
        drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if unit_range:
        ax.set_ylim(-0.02, 1.02)
    if drawn:
        ax.legend(loc="best", fontsize=8)
    else:
        _no_data(ax)


def learning_curve(rows: list[dict], path, *, title: str | None = None) -> pathlib.Path:
    """Success rate and reward against step, from ``metrics.jsonl`` rows; saves a PNG.

    Left: "train/success" (raw, light, and smoothed over ~5% of the points) and "eval/success"
    (markers + line) on [0, 1]. Right: "train/reward" and "eval/reward" likewise. Only keys that
    exist are drawn; a panel without data says so. Returns ``path``.
    """
    rows = [r for r in (rows or []) if isinstance(r, dict)]
    fig = Figure(figsize=(10, 4))
    ax_success, ax_reward = fig.subplots(1, 2)
    _curve_panel(ax_success, rows, "train/success", "eval/success", "success rate",
                 unit_range=True)
    ax_success.set_title("success rate", fontsize=10)
    _curve_panel(ax_reward, rows, "train/reward", "eval/reward", "reward")
    ax_reward.set_title("reward", fontsize=10)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


# ----------------------------------------------------------------------------- credit picture


def _number(v) -> float:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return float("nan")
    return v


def _credit_row(ax, traj: dict) -> None:
    turns = traj.get("turns") or []
    ax.set_title(_short(traj.get("title", ""), 80), fontsize=9, loc="left")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.grid(True, axis="y", alpha=0.3)
    if not turns:
        _no_data(ax, "no turns")
        ax.set_yticks([])
        ax.set_xticks([])
        return
    x = np.arange(len(turns))
    credit = np.array([_number(t.get("credit")) for t in turns])
    reward = np.array([_number(t.get("reward", 0.0)) for t in turns])
    colors = ["tab:green" if c >= 0 else "tab:red" for c in np.nan_to_num(credit)]
    ax.bar(x, np.nan_to_num(credit), color=colors, alpha=0.8, width=0.6)
    ax.set_ylabel("credit", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([_short(t.get("action", "")) for t in turns], rotation=30, ha="right",
                       fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlim(-0.6, len(turns) - 0.4)

    twin = ax.twinx()
    nonzero = np.nan_to_num(reward) != 0
    twin.plot(x[~nonzero], reward[~nonzero], "o", color="gray", markersize=3)
    twin.plot(x[nonzero], reward[nonzero], "*", color="goldenrod", markersize=11,
              markeredgecolor="black", markeredgewidth=0.5)
    twin.set_ylabel("reward", fontsize=8, color="goldenrod")
    twin.tick_params(axis="y", labelsize=7, colors="goldenrod")
    _align_zero(ax, _limits(credit), twin, _limits(reward))


def _limits(values: np.ndarray) -> tuple[float, float]:
    """Padded (lo, hi) spanning 0 and the finite values."""
    finite = values[np.isfinite(values)]
    lo = min(0.0, float(finite.min())) if finite.size else 0.0
    hi = max(0.0, float(finite.max())) if finite.size else 0.0
    if hi - lo == 0:
        hi = 1.0
    pad = 0.1 * (hi - lo)
    return (lo - pad if lo < 0 else lo - 0.02 * (hi - lo)), hi + pad


def _align_zero(ax1, lim1, ax2, lim2) -> None:
    """Set both y ranges so that 0 is at the same height on the two axes."""
    f = max(-lo / (hi - lo) for lo, hi in (lim1, lim2))  # fraction of the axis below 0
    for ax, (lo, hi) in ((ax1, lim1), (ax2, lim2)):
        span = max(-lo / f if f > 0 else 0.0, hi / (1 - f) if f < 1 else 0.0)
        ax.set_ylim(-f * span, (1 - f) * span)


def credit_picture(trajectories: list[dict], path, *, title: str | None = None) -> pathlib.Path:
    """Per-turn credit of up to 6 trajectories, one row each; saves a PNG.

    Each trajectory is ``{"title": str, "turns": [{"action": str, "reward": float,
    "credit": float}, ...]}``. Bars are the credit per turn (green positive, red negative);
    on a twin axis the reward per turn is a gray dot, or a star where it is non-zero. The x
    tick labels are the actions (truncated to 12 characters). Returns ``path``.
    """
    trajectories = [t for t in (trajectories or []) if isinstance(t, dict)]
    shown = trajectories[:_MAX_TRAJECTORIES]
    n = max(1, len(shown))
    height = 0.5 + 2.5 * n
    fig = Figure(figsize=(10, height))
    axes = np.atleast_1d(fig.subplots(n, 1, squeeze=False)[:, 0])
    if not shown:
        _no_data(axes[0])
        axes[0].set_xticks([])
        axes[0].set_yticks([])
    for ax, traj in zip(axes, shown):
        _credit_row(ax, traj)
    head = title or "credit per turn"
    if len(trajectories) > len(shown):
        head += f" ({len(shown)} of {len(trajectories)} trajectories)"
    fig.suptitle(head)
    # fixed margins (inches) instead of tight_layout, which costs ~0.2 s a row here
    top, bottom, gap = 0.75, 0.8, 1.05
    axes_h = (height - top - bottom - (n - 1) * gap) / n
    fig.subplots_adjust(left=0.07, right=0.93, top=1 - top / height, bottom=bottom / height,
                        hspace=gap / axes_h)
    return _save(fig, path)
