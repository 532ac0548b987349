"""``ampspec compare``'s agreement band (torchimpl.cli.agreement) and how the plot draws it."""

from __future__ import annotations

import math

import pytest

from torchimpl.cli.agreement import Band, moving_average, step_noise

N = 200


def _fp32(noise: float = 0.02) -> list[float]:
    # A loss falling from 2.5 towards 0.01, with a deterministic relative wiggle.
    return [(2.5 * math.exp(-i / 35) + 0.01) * (1 + noise * math.sin(1.7 * i)) for i in range(N)]


def test_step_noise_is_the_mean_absolute_change_over_the_window():
    values = [0.0, 1.0, 3.0, 2.0, 2.0]
    assert step_noise(values, 2) == [0.0, 1.0, 1.5, 1.5, 0.5]
    assert moving_average(values, 2) == [0.0, 0.5, 2.0, 2.5, 2.0]


def test_fp32_itself_a_few_steps_early_and_its_own_noise_agree():
    band, ref = Band(), _fp32()
    assert band.agrees(ref, ref)
    ahead = ref[5:] + [ref[-1]] * 5  # reaches each loss five steps earlier
    assert band.agrees(ref, ahead)
    noisier = [v * (1 + 0.03 * math.cos(2.3 * i)) for i, v in enumerate(ref)]
    assert band.agrees(ref, noisier)


def test_a_run_that_levels_off_at_twice_fp32s_final_loss_does_not_agree():
    # Near zero loss the old absolute floor (5 % of the starting loss, 0.13 here) was 13 times
    # the final loss and let this run agree.
    ref = _fp32()
    plateau = [max(v, 2 * ref[-1]) if i > N // 2 else v for i, v in enumerate(ref)]
    assert plateau[-1] - ref[-1] < 0.05 * ref[0]
    assert not Band().agrees(ref, plateau)


def test_stalled_and_diverged_runs_do_not_agree():
    ref = _fp32()
    assert not Band().agrees(ref, [ref[0]] * N)
    assert not Band().agrees(ref, ref[:150] + [math.nan] * 50)
    assert not Band().agrees(ref, ref[:150] + [v * 3 for v in ref[150:]])


def test_the_floor_follows_fp32s_noise_not_its_starting_loss():
    band, ref = Band(), _fp32(noise=0.3)
    half = band.half_widths(ref)
    noise = step_noise(ref, band.window)
    assert half[-1] == pytest.approx(max(0.5 * moving_average(ref, 20)[-1], 3 * noise[-1] / math.sqrt(20)))
    assert half[-1] < 0.05 * ref[0] / 4


# ---------------------------------------------------------------- the plot


def _figure(curves, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot", reason="the plot needs matplotlib (the 'plot' extra)")
    from torchimpl.cli import compare

    rows = [{"precision": k, "steps_skipped": 0} for k in curves]
    compare._judge(rows, curves, Band())
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    return compare, rows, figures


def test_a_run_drawn_exactly_under_another_stays_visible(tmp_path, monkeypatch):
    import numpy as np

    from torchimpl.cli import compare as c

    ref = _fp32()
    other = [v * 1.2 for v in ref]
    curves = {"fp32": c._Curves(ref, [], [1.0] * N, [], False),
              "bf16": c._Curves(other, [], [1.0] * N, [], False),
              "bf16+scaler": c._Curves(list(other), [], [1.0] * N, [], True)}
    compare, rows, figures = _figure(curves, monkeypatch)
    compare._plot(curves, rows, Band(), "t", tmp_path / "p.png")
    fig = figures[0]
    loss_ax = fig.axes[0]
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    box = loss_ax.get_window_extent()
    h = pixels.shape[0]
    area = pixels[int(h - box.y1):int(h - box.y0), int(box.x0):int(box.x1)]

    def count(colour: str) -> int:
        from matplotlib.colors import to_rgb

        rgb = np.array([round(255 * x) for x in to_rgb(colour)])
        return int((np.abs(area - rgb).sum(axis=-1) < 60).sum())

    orange, green = count("C1"), count("C2")  # bf16, bf16+scaler (drawn last)
    assert min(orange, green) > 0.4 * max(orange, green), (orange, green)


def test_the_bands_lower_edge_stays_on_a_log_axis(tmp_path, monkeypatch):
    from torchimpl.cli import compare as c

    # Losses that jump by 60 % from step to step: the noise floor is most of the moving average,
    # and the band's lower edge comes down to a fraction of the lowest curve.
    ref = [(2.5 * math.exp(-i / 35) + 0.01) * (1 + 0.6 * (-1) ** i) for i in range(N)]
    curves = {"fp32": c._Curves(ref, [], [1.0] * N, [], False),
              "bf16": c._Curves([v * 1.1 for v in ref], [], [1.0] * N, [], False)}
    compare, rows, figures = _figure(curves, monkeypatch)
    compare._plot(curves, rows, Band(), "t", tmp_path / "p.png")
    loss_ax = figures[0].axes[0]
    assert loss_ax.get_yscale() == "log"
    bottom = loss_ax.get_ylim()[0]
    (poly,) = loss_ax.collections
    ys = [y for path in poly.get_paths() for _, y in path.vertices]
    assert all(math.isfinite(y) and y >= bottom * (1 - 1e-9) for y in ys), (bottom, min(ys))
    half = Band().half_widths(ref)
    lowest_edge = min(s - h for s, h in zip(moving_average(ref, 20), half) if s - h > 0)
    assert bottom <= lowest_edge  # the edge, where it is above 0, is drawn where it is
