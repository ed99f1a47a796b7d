"""The site's two pictures, drawn as SVG at each build: a run's data flow and the mesh axes.

The mesh picture is drawn from the code's own table of axes (config/mesh.py `AXES`: each
axis, what its devices split, whether the batch's rows go over it, its across-hosts twin),
and an 8-device example laid out by jax's mesh order; the data flow from `FLOW` below, whose
modules a test holds to the files. Plain SVG, no script: it renders offline and in any browser.
"""

from __future__ import annotations

import html
import itertools
import textwrap

# A run's steps, top to bottom: (what happens, the modules that do it).
FLOW = (
    ("config: YAML + key=value overrides, checked", "config/"),
    ("setup: mesh, rules, optimizer, state layout", "run/setup.py, parallel/"),
    ("the sharded train state (restored on resume)", "engine/state.py, checkpointing/"),
    ("grain: the global sampler, this process's rows", "data/pipeline.py"),
    ("device prefetch: global arrays a few batches ahead", "data/prefetch.py"),
    ("train_step(state, batch) -> (state, metrics)", "engine/step.py"),
    ("the loop: log, eval, save, stop", "run/loop.py, observe/"),
    ("metrics.jsonl, TensorBoard, checkpoints", "observe/metrics.py, checkpointing/"),
)
FONT = "font-family='sans-serif'"
MONO = "font-family='monospace'"


def _text(x: float, y: float, text: str, size: int = 13, style: str = FONT, **extra: str) -> str:
    """An SVG text element; `extra` keywords become attributes (font_weight: font-weight)."""
    attributes = " ".join(f"{key.replace('_', '-')}='{value}'" for key, value in extra.items())
    escaped = html.escape(text)
    return f"<text x='{x}' y='{y}' font-size='{size}' {style} {attributes}>{escaped}</text>"


def _svg(width: int, height: int, body: list[str], title: str) -> str:
    """The document: a white page, an arrow head to point with, the body."""
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{html.escape(title)}'>"
        f"<title>{html.escape(title)}</title>"
        "<defs><marker id='arrow' markerWidth='10' markerHeight='8' refX='9' refY='4' "
        "orient='auto'><path d='M0,0 L10,4 L0,8 z' fill='#555'/></marker></defs>"
        f"<rect width='{width}' height='{height}' fill='white'/>"
    )
    return head + "".join(body) + "</svg>\n"


def data_flow() -> str:
    """The data flow of a run: one box per step, its modules beside it, arrows between."""
    box_width, box_height, gap, left = 420, 40, 22, 20
    body = []
    for index, (step, modules) in enumerate(FLOW):
        top = 20 + index * (box_height + gap)
        body.append(
            f"<rect x='{left}' y='{top}' width='{box_width}' height='{box_height}' rx='6' "
            "fill='#e8eef9' stroke='#3f51b5'/>"
        )
        body.append(_text(left + 12, top + 25, step))
        body.append(_text(left + box_width + 16, top + 25, modules, 12, MONO, fill="#444"))
        if index:
            body.append(
                f"<line x1='{left + box_width / 2}' y1='{top - gap}' x2='{left + box_width / 2}' "
                f"y2='{top - 2}' stroke='#555' marker-end='url(#arrow)'/>"
            )
    height = 20 + len(FLOW) * (box_height + gap)
    return _svg(820, height, body, "The data flow of a run")


def mesh_axes() -> str:
    """The mesh axes from config/mesh.py, and the 8 positions of data=2 x fsdp=2 x tensor=2.

    Drawn at the width the page shows it (about 700 px): three axes to a row and four
    devices to a row, so every label reads at its own size (13 px), not scaled down.
    """
    from paisoar_jax.config.mesh import AXES

    column, row_height, body = 232, 132, []
    for index, axis in enumerate(AXES):
        x, y = 20 + (index % 3) * column, 20 + (index // 3) * row_height
        fill = "#e8f5e9" if axis.batch else "#fff3e0"
        body.append(
            f"<rect x='{x}' y='{y}' width='{column - 12}' height='{row_height - 12}' rx='6' "
            f"fill='{fill}' stroke='#777'/>"
        )
        body.append(_text(x + 10, y + 24, f"mesh.{axis.name}", 15, MONO, font_weight="bold"))
        for row, line in enumerate(textwrap.wrap(axis.splits, 26)):  # wrapped to the box
            body.append(_text(x + 10, y + 46 + row * 17, line, 13))
        body.append(_text(x + 10, y + 96, "batch rows" if axis.batch else "", 13, fill="#2e7d32"))
        twin = f"dcn_{axis.name}: across hosts" if axis.dcn else "within a host"
        body.append(_text(x + 10, y + 112, twin, 13, fill="#555"))
    top = 20 + -(-len(AXES) // 3) * row_height + 16
    body.append(_text(20, top, "mesh.data=2 mesh.fsdp=2 mesh.tensor=2: 8 devices", 14))
    for index, (data, fsdp, tensor) in enumerate(itertools.product(range(2), repeat=3)):
        x, y = 20 + (index % 4) * 172, top + 14 + (index // 4) * 96
        body.append(
            f"<rect x='{x}' y='{y}' width='160' height='86' rx='6' fill='#e8eef9' "
            "stroke='#3f51b5'/>"
        )
        body.append(_text(x + 10, y + 20, f"d{data} f{fsdp} t{tensor}", 14, MONO))
        body.append(_text(x + 10, y + 40, f"rows {data * 2 + fsdp + 1} of 4", 13))
        body.append(_text(x + 10, y + 58, f"weights {fsdp + 1} of 2", 13))
        body.append(_text(x + 10, y + 76, f"heads {tensor + 1} of 2", 13))
    caption = "rows over data x fsdp; weights over fsdp; heads and MLP over tensor"
    bottom = top + 14 + 2 * 96 + 12
    body.append(_text(20, bottom, caption, 13, fill="#444"))
    return _svg(20 + 3 * column, bottom + 16, body, "The mesh axes")


def ratio_chart(rows: list[tuple[str, float]]) -> str:
    """Bars of (label, ratio to the peer): a line marks 1.0, the peer's speed."""
    left, scale, bar, gap = 330, 240, 22, 10  # scale: pixels per 1.0x
    body = []
    for index, (label, ratio) in enumerate(rows):
        y = 20 + index * (bar + gap)
        color = "#2e7d32" if ratio >= 1 else "#c62828"
        body.append(_text(20, y + 16, label, 13))
        body.append(
            f"<rect x='{left}' y='{y}' width='{ratio * scale:.1f}' height='{bar}' "
            f"fill='{color}' fill-opacity='0.75'/>"
        )
        body.append(_text(left + ratio * scale + 6, y + 16, f"{ratio:.2f}x", 13))
    bottom = 20 + len(rows) * (bar + gap)
    body.append(
        f"<line x1='{left + scale}' y1='12' x2='{left + scale}' y2='{bottom}' stroke='#555' "
        "stroke-dasharray='4 3'/>"
    )
    body.append(_text(left + scale - 40, bottom + 16, "PyTorch = 1.0x", 12, fill="#555"))
    return _svg(left + 2 * scale - 40, bottom + 26, body, "Speed against the PyTorch peer")


def pictures() -> dict[str, str]:
    """{file name: SVG} of the site's pictures (docs/hooks.py writes them, and the chart)."""
    return {"data-flow.svg": data_flow(), "mesh-axes.svg": mesh_axes()}
