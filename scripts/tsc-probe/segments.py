#!/usr/bin/env python3
"""Per-step medians of a time-stamp probe dump (see README.md here).

usage: segments.py [--ghz 2.1] DUMP...   (one column per dump, e.g. alternating builds)
"""
import statistics
import sys

args = sys.argv[1:]
ghz = 2.1
if args[:1] == ["--ghz"]:
    ghz, args = float(args[1]), args[2:]
# (from point, to point, index shift, name): client points 0-7, server 8-13.
STEPS = [
    (4, 5, 0, "client: start -> post"),
    (5, 8, 0, "request: post -> server recv"),
    (8, 9, 0, "server: decode"),
    (9, 10, 0, "server: -> on_event"),
    (10, 11, 0, "server: handler"),
    (11, 12, 0, "server: answer"),
    (12, 13, 0, "server: -> post"),
    (13, 0, 0, "response: post -> client recv"),
    (0, 1, 0, "client: decode"),
    (1, 2, 0, "client: -> result"),
    (2, 3, 0, "client: result -> Ready"),
    (3, 6, 0, "client: Ready -> caller"),
    (6, 7, 1, "client: harness loop"),
    (7, 4, 0, "client: call -> first poll"),
    (8, 13, 0, "server: recv -> post"),
    (0, 5, 1, "client: recv -> post"),
    (4, 4, 1, "round trip"),
]


def medians(path):
    d = {}
    for line in open(path):
        parts = line.split()
        d[int(parts[0])] = [int(x) for x in parts[1:]]
    n = min(len(v) for v in d.values() if v)
    out = []
    for a, b, shift, _ in STEPS:
        if not d.get(a) or not d.get(b):
            out.append(float("nan"))
            continue
        # Skip the warm-up; one hit of every point per round trip.
        xs = [(d[b][i + shift] - d[a][i]) / ghz for i in range(200, n - 2)]
        out.append(statistics.median(xs))
    return out


cols = [medians(p) for p in args]
print("%-32s" % "step (ns)" + "".join("%10s" % p.split("/")[-1][-9:] for p in args))
for j, (_, _, _, name) in enumerate(STEPS):
    print("%-32s" % name + "".join("%10.0f" % c[j] for c in cols))
