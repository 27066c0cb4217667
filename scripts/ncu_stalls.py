"""Where a kernel's warps wait, from ncu's per-instruction source page: stall reasons overall, the shared-memory
instructions with excess wavefronts (bank conflicts), and the instructions with the most samples.

On the GPU machine (one launch, `--set full`, then the source page as CSV):
    ncu --kernel-name regex:'attn_bwd$' --launch-count 1 --set full --import-source yes -f -o /tmp/r \\
        python scripts/profile_one.py 128 16384 0
    ncu -i /tmp/r.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv
Anywhere: python scripts/ncu_stalls.py sass.csv [top]
"""

import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXCESS_WAVEFRONTS = 1e5  # an instruction's shared-memory wavefronts past the ideal, worth a line


def main(path: str, top: int = 30) -> None:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]  # the first row names the kernel
    column = {name: i for i, name in enumerate(header)}

    def value(row, name):
        try:
            return float(row[column[name]].replace(",", ""))
        except (KeyError, ValueError):
            return 0.0

    total = sum(value(r, SAMPLES) for r in data)
    stalls = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    by_reason = collections.Counter({s: sum(value(r, s) for r in data) for s in stalls})
    print(f"{total:.0f} samples")
    for reason, samples in by_reason.most_common(10):
        print(f"  {reason.removeprefix('stall_'):20s} {100 * samples / total:5.1f}%")
    print("shared-memory instructions with excess wavefronts:")
    for n, r in enumerate(data):
        excess = value(r, "L1 Wavefronts Shared Excessive")
        if excess > EXCESS_WAVEFRONTS:
            print(f"  {n:5d} {r[1].strip()[:60]:60s} executed {value(r, 'Instructions Executed'):.0f}, "
                  f"wavefronts {value(r, 'L1 Wavefronts Shared'):.0f}, excess {excess:.0f}")
    print("instructions by samples (line, share, main reason):")
    for n in sorted(range(len(data)), key=lambda n: -value(data[n], SAMPLES))[:top]:
        r = data[n]
        reason = max(stalls, key=lambda s: value(r, s)).removeprefix("stall_")
        print(f"  {n:5d} {100 * value(r, SAMPLES) / total:5.2f}% {reason:16s} {r[1].strip()[:70]}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
