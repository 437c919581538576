"""Fuzz the readers of untrusted inputs: JPEG decode, tar shards, cache headers (issue 24), token
indexes, shard indexes and loaded states (issue 35).

    python scripts/checks/fuzz.py --seconds 600                  # every target, 600 s each
    python scripts/checks/fuzz.py --target tar --seconds 3600 --corpus fuzz_corpus

Targets (each takes one input's bytes):

- ``jpeg``: ``vision.decode.read_header``, ``decode_into``, ``decode_crop_into`` and the
  ``_jpeg`` extension called directly with integer arguments taken from the input's first bytes.
  Allowed outcome: SampleError (ValueError/OverflowError from the extension's argument checks).
- ``tar``: ``tar_reader.TarReader`` over the bytes (as a file and as a stream) and
  ``webdataset.count_samples`` and reading of the bytes written as a shard. Allowed: SampleError.
- ``cache``: the bytes are the JSON header of a real small cache, written with valid checksums
  (so the header's schema is what is fuzzed), then opened, every sample read and verified.
  Allowed: CacheError.
- ``state``: a real loader, sampler, elastic or WebDataset state with numbers and types changed
  as the bytes say (``mutate_state``), loaded, then its first batches drawn. Allowed:
  ValueError (StateMismatch), TypeError.
- ``tokidx``: the bytes are a token ``.idx`` (beside a ``.bin`` of the size its header
  announces, when that is small), opened with ``tokens.TokenDataset`` and every document read.
  Allowed: TokenFileError.
- ``shardidx``: the bytes are the ``.idx.json`` of a real small shard, loaded with
  ``shard_index.load_index`` and every entry read with ``shard_index.read_sample`` (the checks
  global shuffle makes). Allowed: SampleError (ShardIndexError, ShardFormatError).

Anything else (another exception, a crash, a hang past libFuzzer's timeout) is a finding. The
script makes its own seed corpus (small JPEGs, ``shards write``-like tars, one cache) in
``--corpus`` (default: a temporary folder). With atheris installed (``pip install atheris``) each
target runs under libFuzzer, coverage-guided, in a process of its own; without it, or with
``--engine random``, a seeded random mutator runs the same targets. Findings are written to
``--artifacts`` (default ``fuzz_artifacts/``); the exit status is 1 if there is one.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
# pooled_loader is imported by _load(), after atheris (if used) has hooked its imports


def _load() -> None:
    global pl_cache, pl_format, pl_errors, pl_tar, pl_wds, pl_decode, pl_tokens, pl_index
    global pl_samples
    import pooled_loader.cache as pl_cache
    import pooled_loader.shards.index as pl_index
    import pooled_loader.tokens as pl_tokens
    import pooled_loader.cache.format as pl_format
    import pooled_loader.errors as pl_errors
    import pooled_loader.shards.tar as pl_tar
    import pooled_loader.vision.decode as pl_decode
    import pooled_loader.shards.webdataset as pl_wds
    import pooled_loader.shards.samples as pl_samples

TARGETS = ("jpeg", "tar", "cache", "state", "tokidx", "shardidx")
SMALL_BIN = 1 << 20  # tokidx: a .bin is written at the announced size up to this
MAX_LEN = 1 << 16  # inputs longer than this are cut: the bugs sought live in headers


# -- seed corpus ------------------------------------------------------------------------------

def make_corpus(root: str) -> None:
    """Seeds per target in ``root/TARGET/``."""
    import simplejpeg
    from PIL import Image
    rng = np.random.default_rng(0)
    for t in TARGETS:
        os.makedirs(os.path.join(root, t), exist_ok=True)
    jpegs = []
    for i, (h, w, sub) in enumerate([(16, 16, "444"), (33, 47, "420"), (8, 64, "422"),
                                     (64, 24, "411"), (1, 9, "420")]):
        img = rng.integers(0, 256, (h, w, 3), np.uint8)
        jpegs.append(simplejpeg.encode_jpeg(img, quality=80, colorsubsampling=sub))
    grey = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (20, 30), np.uint8)).save(grey, "JPEG", progressive=True)
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (12, 10, 3), np.uint8)).save(png, "PNG")
    jpegs += [grey.getvalue(), png.getvalue()]
    for i, data in enumerate(jpegs):  # 16 bytes of integer arguments (see _ints), the image
        _put(root, "jpeg", i, bytes(rng.integers(0, 200, 16, np.uint8)) + data)
    for i, fmt in enumerate((tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT)):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
            _add(tf, "__classes__", b'["a", "b"]')
            for k in range(3):
                name = f"{'d' * 40 * i}/{k:04d}" if fmt != tarfile.USTAR_FORMAT else f"{k:04d}"
                _add(tf, f"{name}.cls", str(k % 2).encode())
                _add(tf, f"{name}.jpg", jpegs[k][:300])
        _put(root, "tar", i, out.getvalue())
    _put(root, "cache", 0, _base_cache()[1])
    _put_state_seeds(root)
    with tempfile.TemporaryDirectory() as d:
        for i, docs in enumerate(([[1, 2, 3], [], [4] * 9], [list(range(40))] * 5, [])):
            pl_tokens.write_tokens(os.path.join(d, "t"), docs,
                                   dtype=np.uint16 if i else np.int64)
            _put(root, "tokidx", i, open(os.path.join(d, "t.idx"), "rb").read())
    _put(root, "shardidx", 0, _base_shard()[1])


def _put(root: str, target: str, i: int, data: bytes) -> None:
    with open(os.path.join(root, target, f"seed{i}"), "wb") as f:
        f.write(data)


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


class _Tiny:
    """A dataset of every leaf kind the cache stores."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return {"img": np.full((3, 4, 3), i, np.uint8), "label": i, "name": f"n{i}",
                "raw": bytes([i]) * i, "w": np.float32(i), "none": None}

    def __repr__(self) -> str:
        return "_Tiny()"


_BASE: tuple = ()


def _base_cache() -> tuple[bytes, bytes, int]:
    """(file bytes up to the header, header JSON, header offset) of a small real cache."""
    global _BASE
    if not _BASE:
        with tempfile.TemporaryDirectory() as d:
            path = pl_cache.build_cache(_Tiny(), os.path.join(d, "t.plc"), progress=False)
            raw = open(path, "rb").read()
        p = pl_format.unpack_preamble(raw[:pl_format.PREAMBLE_SIZE], "seed")
        _BASE = (raw[:p.hdr_off], raw[p.hdr_off:p.hdr_off + p.hdr_len], p.hdr_off)
    return _BASE


_SHARD: tuple = ()


def _base_shard() -> tuple[bytes, bytes]:
    """(tar bytes, index JSON) of a small real shard."""
    global _SHARD
    if not _SHARD:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
            _add(tf, "__classes__", b'["a"]')
            for k in range(4):
                _add(tf, f"{k:04d}.cls", b"0")
                _add(tf, f"{k:04d}.txt", b"x" * (k * 300))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.tar")
            with open(path, "wb") as f:
                f.write(out.getvalue())
            _SHARD = (out.getvalue(), open(pl_index.write_index(path), "rb").read())
    return _SHARD


# -- targets ----------------------------------------------------------------------------------

def _ints(data: bytes, n: int, wide: bool) -> tuple[list[int], bytes]:
    """``n`` signed integers from the first bytes of ``data`` (small ones, mostly), and the rest."""
    out, limit = [], (1 << 63) - 1 if wide else 1 << 40
    for i in range(n):
        b = data[i * 2:i * 2 + 2].ljust(2, b"\0")
        out.append(((b[1] - 128) * 97) if b[0] < 200 else
                   random.Random(b[1]).randint(-limit, limit) if b[0] < 250 else
                   (limit, -limit - 1, 1 << 31, -(1 << 31), 1 << 32, 0)[b[1] % 6])
    return out, data[2 * n:]


def fuzz_jpeg(data: bytes, wide: bool) -> None:
    decode, SampleError = pl_decode, pl_errors.SampleError
    (f, fast, x0, y0, w, h, oh, ow), data = _ints(data, 8, wide)
    factor = decode.JPEG_SCALES[f % 4]
    buf = np.empty(1 << 20, np.uint8)
    alloc = lambda n: buf if n <= len(buf) else np.empty(n, np.uint8)  # noqa: E731
    try:
        header = decode.read_header(data)
        decode.decode_into(data, header, alloc, factor, bool(fast & 1))
        box = (abs(x0) % header.width, abs(y0) % header.height, 1 + abs(w) % header.width,
               1 + abs(h) % header.height)
        box = (box[0], box[1], min(box[2], header.width - box[0]),
               min(box[3], header.height - box[1]))
        decode.decode_crop_into(data, header, alloc, factor, box,
                                (1 + abs(oh) % 64, 1 + abs(ow) % 64), bool(fast & 2))
    except SampleError:
        pass
    if decode._jpeg is not None:
        try:
            decode._jpeg.decode(data, buf, factor, x0, y0, w, h, bool(fast & 4))
        except (ValueError, OverflowError):
            pass


def fuzz_tar(data: bytes, path: str) -> None:
    SampleError = pl_errors.SampleError
    for stream in (False, True):
        src = io.BytesIO(data)
        f = io.BufferedReader(_Stream(src)) if stream else src
        try:
            r = pl_tar.TarReader(f, "fuzz.tar")
            for m in r:
                if m.isreg():
                    r.read(m)
        except SampleError:
            pass
    with open(path, "wb") as f:
        f.write(data)
    for call in (lambda: pl_wds.count_samples(path), lambda: list(pl_samples.shard_samples(path))):
        try:
            call()
        except SampleError:
            pass


class _Stream(io.RawIOBase):
    def __init__(self, src: io.BytesIO) -> None:
        self.src = src

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self.src.readinto(b)


def fuzz_cache(hb: bytes, path: str) -> None:
    body, _, off = _base_cache()
    with open(path, "wb") as f:
        f.write(pl_format.pack_preamble(pl_format.STATE_COMPLETE, off, len(hb), zlib.crc32(hb))
                + body[64:] + hb)
    try:
        ds = pl_cache.CachedDataset(path)
        for i in range(len(ds)):
            for k in range(ds.variants):
                ds.raw(i, k)
        ds.verify()
    except pl_cache.CacheError:
        pass


def fuzz_tokidx(data: bytes, path: str) -> None:
    with open(path + ".idx", "wb") as f:
        f.write(data)
    head = data[:pl_tokens.HEADER.size]
    nbytes = 0
    if len(head) == pl_tokens.HEADER.size:
        tokens, dtype = pl_tokens.HEADER.unpack(head)[3], head[12:16].rstrip(b"\0")
        nbytes = tokens * (8 if dtype == b"<i8" else 2 if dtype == b"<u2" else 4)
    with open(path + ".bin", "wb") as f:
        f.truncate(nbytes if nbytes <= SMALL_BIN else 64)
    try:
        ds = pl_tokens.TokenDataset(path)
        for i in range(min(len(ds), 1000)):
            ds[i]
        ds.lengths()
    except pl_tokens.TokenFileError:
        pass


def fuzz_shardidx(data: bytes, shard: str) -> None:
    if not os.path.exists(shard):
        with open(shard, "wb") as f:
            f.write(_base_shard()[0])
    with open(pl_index.index_url(shard), "wb") as f:
        f.write(data)
    try:
        ix = pl_index.load_index(shard)
        for i in range(len(ix)):
            pl_index.read_sample(shard, ix, i)
    except pl_errors.SampleError:
        pass


def target_fn(name: str, scratch: str, wide: bool):
    path = os.path.join(scratch, f"input.{name}")
    if name == "jpeg":
        return lambda data: fuzz_jpeg(data, wide)
    if name == "tar":
        return lambda data: fuzz_tar(data, path + ".tar")
    if name == "state":
        return fuzz_state
    if name == "tokidx":
        return lambda data: fuzz_tokidx(data, path)
    if name == "shardidx":
        return lambda data: fuzz_shardidx(data, path + ".tar")
    return lambda data: fuzz_cache(data, path)


# -- state target (issue 35): a real state, its numbers and types mutated ----------------------
# The input is a mutation program, not the state's text: its first byte picks one of the real
# states below (JSON round-tripped), and each following 3 bytes pick a value in it (a number,
# a flag, a list or a dict, by position) and what to put there. The state is then loaded, and
# the first batches drawn: ValueError (StateMismatch) and TypeError are the allowed outcomes.

HOSTILE = (-1, 0, 1, 2, -8, 512, 10 ** 6, 10 ** 12, 10 ** 18, 2 ** 63, 2 ** 64, -(2 ** 63) - 1,
           True, False, None, "1", 1.5, [], {}, [0, 1], [[0, 1]], [[0, 1, 1]], {"0": [[0, 1]]},
           "worker_7", [3, [0] * 625, None])
_STATES: list = []


class _Lengths:
    """A map-style dataset of 24 integers (each its own length, for the length samplers)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        return i


def _state_bases() -> list:
    """(kind, state) of real loaders and datasets, built once per process."""
    if _STATES:
        return _STATES
    from pooled_loader import shards
    from pooled_loader.resume import merge_rank_states
    root = tempfile.mkdtemp(prefix="fuzz_state_")
    sizes = [5, 7, 3]
    for s, n in enumerate(sizes):  # shards of ids 0..14, with their indexes
        with tarfile.open(os.path.join(root, f"s-{s}.tar"), "w") as tf:
            for k in range(sum(sizes[:s]), sum(sizes[:s + 1])):
                _add(tf, f"{k:04d}.txt", str(k).encode())
    with contextlib.redirect_stdout(io.StringIO()):
        assert shards.main(["index", root]) == 0
    for kind in _STATE_KINDS:
        if kind in ("rank", "merged"):  # a 2-rank world's states
            states = []
            for r in range(2):
                loader = _state_loader(kind, root, (r, 2))
                it = iter(loader)
                next(it)
                states.append(loader.state_dict())
            state = merge_rank_states(states) if kind == "merged" else states
        else:
            made = _state_loader(kind, root)
            it = iter(made)
            for _ in range(2):
                next(it)
            state = made.state_dict()
            if kind == "streams":
                state = merge_rank_states([state])
        _STATES.append((kind, root, json.loads(json.dumps(state))))
    return _STATES


def _txt(sample: dict) -> int:
    return int(sample["txt"])


def _state_loader(kind: str, root: str, rank_world: tuple = (0, 1)):
    """A loader (or a WebDataset) of ``kind``; ``rank_world``: its (RANK, WORLD_SIZE)."""
    os.environ.update(RANK=str(rank_world[0]), WORLD_SIZE=str(rank_world[1]))
    from pooled_loader import PooledLoader
    from pooled_loader.samplers import LengthGroupedSampler, TokenBudgetBatchSampler
    from pooled_loader.webdataset import WebDataset
    lengths = list(range(1, 25))
    if kind == "map":
        return PooledLoader(_Lengths(), batch_size=3, shuffle=True)
    if kind == "length":
        return PooledLoader(_Lengths(), batch_size=3, sampler=LengthGroupedSampler(
            lengths, 3, num_replicas=1, rank=0, mega_batch_mult=2))
    if kind == "budget":
        return PooledLoader(_Lengths(), batch_sampler=TokenBudgetBatchSampler(
            lengths, 40, num_replicas=1, rank=0, mega_batch_mult=2))
    if kind in ("rank", "merged"):
        return PooledLoader(_Lengths(), batch_size=3, shuffle=True, distributed=True)
    if kind in ("wds", "global"):
        return WebDataset(root, transform=_txt, seed=1, shuffle_buffer=3 if kind == "wds" else 0,
                          shuffle="global" if kind == "global" else "shards")
    return PooledLoader(WebDataset(root, transform=_txt, seed=1), batch_size=2)


_STATE_KINDS = ("map", "length", "budget", "rank", "merged", "wds", "global", "streams")


def _slots(node, path=()):
    """Every (container, key) below ``node``, containers before their contents."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, value in items:
        yield node, key
        if isinstance(value, (dict, list)) and len(value) < 700:
            yield from _slots(value)


def mutate_state(data: bytes, state):
    """``state`` (a deep copy) changed as ``data`` says (see the comment above)."""
    state = json.loads(json.dumps(state))
    for i in range(1, len(data) - 2, 3):
        slots = list(_slots(state))
        if not slots:
            break
        node, key = slots[int.from_bytes(data[i:i + 2], "little") % len(slots)]
        op = data[i + 2]
        old = node[key]
        if op < 16 and isinstance(node, dict):
            del node[key]
        elif op < 48 and isinstance(old, int) and not isinstance(old, bool):
            node[key] = old + (op % 7) - 3 if op < 40 else old * 2 + 1
        else:
            node[key] = json.loads(json.dumps(HOSTILE[op % len(HOSTILE)]))
    return state


def fuzz_state(data: bytes) -> None:
    import itertools
    if not data:
        return
    bases = _state_bases()
    kind, root, base = bases[data[0] % len(bases)]
    state = mutate_state(data, base)
    elastic = kind in ("rank", "merged")
    try:
        if kind == "rank":
            from pooled_loader.resume import merge_rank_states
            state = merge_rank_states(state)
        # elastic states resume on another world size
        target = _state_loader("merged" if elastic else kind, root, (0, 3) if elastic else (0, 1))
        target.load_state_dict(state)
        for _ in itertools.islice(iter(target), 3):
            pass
    except (ValueError, TypeError):
        pass


def _put_state_seeds(root: str) -> None:
    os.makedirs(os.path.join(root, "state"), exist_ok=True)
    for i in range(8):  # each real state unchanged, then once with a value changed
        _put(root, "state", i, bytes([i]))
        _put(root, "state", 8 + i, bytes([i, 5, 0, 200]))


# -- engines ----------------------------------------------------------------------------------

def mutate(data: bytes, rng: random.Random, corpus: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        op = rng.randrange(6)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(i, len(b) - 1)] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        elif op == 2:
            b[i:i + rng.randrange(1, 64)] = b""
        elif op == 3:
            b[i:i] = rng.randbytes(rng.randrange(1, 16))
        elif op == 4:
            other = rng.choice(corpus)
            j = rng.randrange(len(other) + 1)
            b[i:i + rng.randrange(64)] = other[j:j + rng.randrange(1, 512)]
        else:
            digits = str(rng.choice((0, 1, -1, 2**31, 2**32, 2**40, 2**63, 10**30)))
            b[i:i + len(digits)] = digits.encode()  # numbers: sizes, counts, offsets
    return bytes(b[:MAX_LEN])


def run_random(name: str, seeds: list[bytes], seconds: float, seed: int, artifacts: str,
               wide: bool, scratch: str) -> int:
    fn, rng = target_fn(name, scratch, wide), random.Random(seed)
    deadline, runs = time.monotonic() + seconds, 0
    corpus = list(seeds)
    while time.monotonic() < deadline:
        data = mutate(rng.choice(corpus), rng, corpus) if runs >= len(seeds) else seeds[runs]
        try:
            fn(data)
        except Exception:  # noqa: BLE001 - a finding
            return _report(name, data, traceback.format_exc(), artifacts)
        runs += 1
        if rng.random() < 0.01:
            corpus.append(data)  # keep a few mutants to mutate further
    print(f"{name}: {runs} runs in {seconds:.0f} s (random mutator, seed {seed}), no finding")
    return 0


def _report(name: str, data: bytes, tb: str, artifacts: str) -> int:
    os.makedirs(artifacts, exist_ok=True)
    path = os.path.join(artifacts, f"{name}-{zlib.crc32(data):08x}")
    with open(path, "wb") as f:
        f.write(data)
    print(f"{name}: FINDING, input saved to {path}\n{tb}", file=sys.stderr)
    return 1


def run_atheris(name: str, corpus_dir: str, seconds: float, artifacts: str, wide: bool,
                scratch: str, seed: int) -> None:
    import atheris
    _base_cache()
    fn = target_fn(name, scratch, wide)
    os.makedirs(artifacts, exist_ok=True)
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", f"-max_len={MAX_LEN}",
                   "-timeout=20", "-rss_limit_mb=4096", f"-artifact_prefix={artifacts}/{name}-",
                   f"-seed={seed + 1}",  # 0 would mean a random seed
                   corpus_dir], fn)
    atheris.Fuzz()  # exits the process


def extension_checks_wide_ints() -> bool:
    """Whether the JPEG extension rejects region arguments whose sum overflows (issue 24's
    first JPEG item), probed in a process of its own, since an unfixed build may write out of
    bounds. Without that fix the jpeg target draws integers below 2**40 only."""
    probe = ("import numpy as np, simplejpeg; from pooled_loader.vision import _jpeg\n"
             "d = simplejpeg.encode_jpeg(np.zeros((16, 16, 3), np.uint8))\n"
             "try: _jpeg.decode(d, np.empty(1 << 16, np.uint8), 1, 2**62, 0, 2**62, 8)\n"
             "except ValueError: print('checked')")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    return r.stdout.strip() == "checked"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=TARGETS + ("all",), default="all")
    ap.add_argument("--seconds", type=float, default=60, help="per target")
    ap.add_argument("--engine", choices=("auto", "atheris", "random"), default="auto")
    ap.add_argument("--corpus", default=None, help="seed corpus folder (made if missing)")
    ap.add_argument("--artifacts", default="fuzz_artifacts")
    ap.add_argument("--seed", type=int, default=0, help="random engine's seed")
    ap.add_argument("--replay", default=None, metavar="FILE",
                    help="run --target once on FILE (a finding) and show what it raises")
    ap.add_argument("--wide-ints", choices=("auto", "yes", "no"), default="auto",
                    help="jpeg target: integers up to 2**63 (auto: if the extension checks them)")
    args = ap.parse_args()
    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # noqa: F401
            engine = "atheris"
        except ImportError:
            engine = "random"
    if engine == "atheris" and args.target != "all":
        import atheris
        with atheris.instrument_imports(include=["pooled_loader"]):  # for coverage
            _load()
    else:
        _load()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus or os.path.join(tmp, "corpus")
        if not os.path.isdir(os.path.join(corpus, "tar")):
            make_corpus(corpus)
        if args.target == "all":  # one process per target: libFuzzer owns its process
            cmd = [sys.executable, os.path.abspath(__file__), "--corpus", corpus, "--seconds",
                   str(args.seconds), "--engine", engine, "--artifacts", args.artifacts,
                   "--seed", str(args.seed), "--wide-ints", args.wide_ints]
            return max(subprocess.call(cmd + ["--target", t]) for t in TARGETS)
        wide = args.wide_ints == "yes" or (args.wide_ints == "auto" and args.target == "jpeg"
                                           and extension_checks_wide_ints())
        if args.target == "jpeg":
            print(f"jpeg: integer arguments up to {'2**63' if wide else '2**40'}")
        if args.replay:
            target_fn(args.target, tmp, wide)(open(args.replay, "rb").read())
            print(f"{args.target}: {args.replay}: no finding")
            return 0
        tdir = os.path.join(corpus, args.target)
        if engine == "atheris":
            run_atheris(args.target, tdir, args.seconds, args.artifacts, wide, tmp, args.seed)
        seeds = [open(os.path.join(tdir, f), "rb").read() for f in sorted(os.listdir(tdir))]
        if args.target == "cache":
            seeds += [_base_cache()[1]]
        return run_random(args.target, seeds, args.seconds, args.seed, args.artifacts, wide, tmp)


if __name__ == "__main__":
    sys.exit(main())
