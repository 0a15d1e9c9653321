"""A grouped bar chart as a standalone SVG (no plotting library needed)."""
from xml.sax.saxutils import escape

COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]


def bar_chart(title, groups, series, values, unit="", baseline=None, width=760, height=380):
    """groups: x labels; series: legend labels; values[s][g]: a number or None."""
    left, right, top, bottom = 60, 20, 40, 70
    plot_w, plot_h = width - left - right, height - top - bottom
    vmax = max([v for row in values for v in row if v is not None] + [baseline or 0, 1e-9]) * 1.15
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for i in range(6):
        v = vmax * i / 5
        y = top + plot_h - plot_h * i / 5
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    if unit:
        out.append(f'<text x="14" y="{top + plot_h / 2}" transform="rotate(-90 14 {top + plot_h / 2})" text-anchor="middle">{escape(unit)}</text>')
    gw = plot_w / max(len(groups), 1)
    bw = gw * 0.8 / max(len(series), 1)
    for g, label in enumerate(groups):
        x0 = left + g * gw + gw * 0.1
        for s in range(len(series)):
            v = values[s][g]
            if v is None:
                continue
            h = plot_h * v / vmax
            x, y = x0 + s * bw, top + plot_h - h
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="{h:.1f}" fill="{COLORS[s % len(COLORS)]}"><title>{escape(series[s])} {escape(label)}: {v:.3g}</title></rect>')
            out.append(f'<text x="{x + bw / 2 - 1:.1f}" y="{y - 3:.1f}" text-anchor="middle" font-size="10">{v:.3g}</text>')
        out.append(f'<text x="{left + g * gw + gw / 2:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{escape(label)}</text>')
    if baseline is not None:
        y = top + plot_h - plot_h * baseline / vmax
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="black" stroke-dasharray="4 3"/>')
    for s, name in enumerate(series):
        x = left + s * (plot_w / max(len(series), 1))
        out.append(f'<rect x="{x:.1f}" y="{height - 22}" width="12" height="12" fill="{COLORS[s % len(COLORS)]}"/>')
        out.append(f'<text x="{x + 16:.1f}" y="{height - 12}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
