"""The command line the decode-step benchmarks share (``state_copy.py``, ``donated_step.py``)."""

from __future__ import annotations

import argparse


def decode_parser(doc: str, prompt: int, rounds: int) -> argparse.ArgumentParser:
    """A parser for a benchmark of one converted model's decode step over several batch sizes, with
    the defaults each states for ``--prompt`` (tokens read first) and ``--rounds``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model", help="a converted model directory")
    parser.add_argument("--batches", default="1,8,32", help="sequences decoded per step, comma-separated")
    parser.add_argument("--prompt", type=int, default=prompt, help="tokens each sequence reads before the timed steps")
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser
