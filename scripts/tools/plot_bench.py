#!/usr/bin/env python
"""Plot a bench_images.py JSON result: images/s per loader, with the ratio to ours.

    python scripts/tools/plot_bench.py bench_out/images_final2.json docs/images_bench.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "ours": "PooledLoader (JPEG)", "ours_cached": "PooledLoader (cache, max side 512)",
    "torch_pil": "DataLoader + Pillow", "webdataset": "WebLoader + Pillow",
    "dali": "DALI CPU", "dali_fused": "DALI CPU, fused crop-decode",
    "ffcv_jpg": "FFCV JPEG", "ffcv_raw": "FFCV RAW",
    "ceiling": "ceiling: decode+resize loop", "ceiling_dct": "ceiling with DCT scaling",
}


def main(argv: list[str]) -> int:
    if argv[:1] in (['-h'], ['--help']):
        print(__doc__)
        return 0
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        result = json.load(f)
    rows = [(name, s) for name, s in result["summary"].items() if s.get("status") == "ok"]
    rows.sort(key=lambda r: r[1]["median"])
    names = [LABELS.get(n, n) for n, _ in rows]
    rates = [s["median"] for _, s in rows]
    colors = ["tab:green" if n.startswith("ours") else "tab:gray" if n.startswith("ceiling")
              else "tab:blue" for n, _ in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh(names, rates, color=colors)
    for y, ((name, s), rate) in enumerate(zip(rows, rates)):
        x = s.get("x_ours")  # this loader / ours, median of per-round ratios
        if name == "ours" or not x:
            note = ""
        elif name.startswith("ours"):
            note = f"{x:.2f}x our JPEG path"
        elif name.startswith("ceiling"):
            note = f"ours reaches {1 / x:.0%}"
        else:
            note = f"ours is {1 / x:.2f}x"
        ax.text(rate, y, f" {rate:,.0f}" + (f"   ({note})" if note else ""), va="center",
                fontsize=8)
    cfg, host = result["config"], result["host"]
    ax.set_xlabel("images/s (median of timed epochs)")
    ax.set_title(f"{cfg['images']} JPEGs, RandomResizedCrop {cfg['size']} + flip, uint8 CHW\n"
                 f"batch {cfg['batch']}, {cfg['workers']} workers, {host['cpu_count']} cores, "
                 f"same run ({host['time'][:16]})", fontsize=9)
    ax.set_xlim(0, max(rates) * 1.45)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
