"""Count sketch of a d-dimensional vector: an r × c table, hashes from small seeded tables.

Pure torch; imports no Flower. ALGORITHMS.md §3: row j has a bucket hash h_j: [d] → [c] and a
sign hash s_j: [d] → {±1}; sketching adds s_j(i)·g_i into T[j, h_j(i)]. The sketch is linear,
so tables from many sites can be added (or averaged) and momentum and error feedback can run on
tables. Estimate of g_i: the median over rows of s_j(i)·T[j, h_j(i)].

Hashes. Row j hashes a coordinate to one of 2c signed buckets q_j(i) ∈ [0, 2c): bucket
h_j(i) = q_j(i) mod c, sign +1 when q_j(i) < c and −1 otherwise. q is additive tabulation
over the two halves of i (low ``LOW_BITS`` bits, high bits)::

    q_j(i) = (L_j(i mod B) + H_j(i div B)) mod 2c,     B = 2^LOW_BITS
    L_j(x) = ((a_j·x + b_j) mod p) mod 2c,   H_j(y) = ((a'_j·y + b'_j) mod p) mod 2c

with p = 2^31 − 1 and (a, b), (a', b') drawn from ``derive_seed(seed, "count-sketch", j, ...)``,
so every site and the server build identical hashes from the seed sent in the round config, in
any process and on any device. L and H are small tables (B and d/B entries per row), computed
in int64 where a·x + b < 2^62 cannot overflow (a well-known library computes such a product in
a range that overflows and leaves most buckets of a row unused). q is pairwise independent:
two coordinates in the same block differ through two independent L entries, two in different
blocks through two independent H entries; so the pair (bucket, sign) of one coordinate is
uniform and independent of another's, which is all the count-sketch analysis needs.

Why tables and not a·i + b per coordinate: within a block of B coordinates H_j is one number,
so q_j is the fixed index vector L_j shifted by H_j. Sketching a block into row j is then one
``scatter_add_`` of the vector's slice, with the cached L_j as indices, into the window
[H_j, H_j + 2c) of a 4c-wide scratch row (no wrap-around to compute); the four quarters fold
back into the row as T = Q0 − Q1 + Q2 − Q3 (quarters 1 and 3 hold the negative signs). No
per-coordinate hash arithmetic remains, and no r × d index table is stored: the index memory
is r·(B + d/B) integers. Estimation gathers from the same windows of [T, −T, T, −T], and
``top_k_largest`` (below) finds the k largest estimates without sorting or
heap-selecting all d.

Determinism: on CPU every operation is sequential and exact given the inputs. On CUDA
``index_add_`` uses atomic float additions, so the sum order inside a bucket (and hence the last
bits of a table entry) can vary unless ``torch.use_deterministic_algorithms(True)`` is set;
estimation and top-k never use ``torch.median`` along a dim (not deterministic on CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from flplatform.core.checks import Problem, integer, require
from flplatform.core.errors import ConfigError
from flplatform.core.seeding import derive_seed

P = 2**31 - 1  # Mersenne prime; every table entry comes from a value < p
MAX_DIM = 2**31  # coordinates below 2^31: H has fewer than 2^14 entries per row
MAX_COLS = 2**30  # signed buckets (< 2c) fit int32 indices
# Rows of a sketch: a median over more is of no use (the papers use 1 to 7), and each row's
# hashes are drawn in a Python loop, so that a server's 10^12 rows would hang a site.
MAX_ROWS = 255
LOW_BITS = 17  # B = 131,072 coordinates per block: one row's L takes 512 KiB in int32
BLOCK = 1 << LOW_BITS
LARGEST_SAMPLE = 1 << 16  # entries in top_k_largest's threshold sample
DEFAULT_CHUNK = 1 << 20  # coordinates per pass: estimation's votes are r × chunk floats
HASH_TAG = "count-sketch"


def _positive_int(name: str, value: int) -> Problem:
    return integer(value, f"count sketch {name}", minimum=1, says="a positive integer")


@dataclass(frozen=True)
class SketchHashes:
    """Hash parameters of an r-row count sketch with c columns.

    Parameters
    ----------
    cols : int
        Number of buckets c per row.
    low_a, low_b : tuple of int
        Per-row (a_j, b_j) of the table L_j over a coordinate's low bits; 1 <= a_j < p,
        0 <= b_j < p.
    high_a, high_b : tuple of int
        Per-row (a'_j, b'_j) of the table H_j over its high bits, drawn independently.

    Notes
    -----
    The number of rows r = len(low_a) must be odd, so the median over rows is one element
    (no averaging of two middle values, which would mix two collisions).
    """

    cols: int
    low_a: tuple[int, ...]
    low_b: tuple[int, ...]
    high_a: tuple[int, ...]
    high_b: tuple[int, ...]

    def __post_init__(self) -> None:
        rows = len(self.low_a)
        require(_positive_int("cols", self.cols), _positive_int("rows", rows))
        if self.cols >= MAX_COLS:
            raise ConfigError(f"count sketch cols must be < 2^30, got {self.cols}")
        if rows % 2 == 0:
            raise ConfigError(f"count sketch rows must be odd (median of one element), got {rows}")
        for name in ("low_b", "high_a", "high_b"):
            if len(getattr(self, name)) != rows:
                raise ConfigError(f"count sketch {name} must have {rows} entries like low_a")
        for name in ("low_a", "high_a"):
            if not all(1 <= int(a) < P for a in getattr(self, name)):
                raise ConfigError(f"count sketch {name} entries must be in [1, 2^31 - 1)")
        for name in ("low_b", "high_b"):
            if not all(0 <= int(b) < P for b in getattr(self, name)):
                raise ConfigError(f"count sketch {name} entries must be in [0, 2^31 - 1)")

    @classmethod
    def from_seed(cls, seed: int, rows: int, cols: int) -> SketchHashes:
        """Derive the parameters of row j from ``derive_seed(seed, "count-sketch", j, part)``."""
        require(_positive_int("rows", rows))
        if rows > MAX_ROWS:  # before drawing them (the rest is checked once drawn)
            raise ConfigError(f"count sketch rows must be at most {MAX_ROWS}, got {rows}")

        def draw(j: int, part: str, low: int) -> int:
            # low = 1 for multipliers (a = 0 would make a table constant)
            return low + derive_seed(seed, HASH_TAG, j, part) % (P - low)

        return cls(
            cols=cols,
            low_a=tuple(draw(j, "low-a", 1) for j in range(rows)),
            low_b=tuple(draw(j, "low-b", 0) for j in range(rows)),
            high_a=tuple(draw(j, "high-a", 1) for j in range(rows)),
            high_b=tuple(draw(j, "high-b", 0) for j in range(rows)),
        )

    @property
    def rows(self) -> int:
        """Number of rows r."""
        return len(self.low_a)

    def table(self, a: tuple[int, ...], b: tuple[int, ...], size: int) -> torch.Tensor:
        """((a_j·x + b_j) mod p) mod 2c for x < size, as an (r, size) int64 CPU tensor."""
        x = torch.arange(size, dtype=torch.int64)  # (size,); a·x + b < 2^31·2^31 + 2^31
        a_col = torch.tensor(a, dtype=torch.int64).view(-1, 1)
        b_col = torch.tensor(b, dtype=torch.int64).view(-1, 1)
        return (a_col * x).add_(b_col).remainder_(P).remainder_(2 * self.cols)


class _HashTables:
    """L and H of one sketch on one device; built once and cached (see ``_hash_tables``)."""

    def __init__(self, hashes: SketchHashes, d: int, device: torch.device) -> None:
        low = hashes.table(hashes.low_a, hashes.low_b, min(d, BLOCK))  # (r, min(d, B))
        high = hashes.table(hashes.high_a, hashes.high_b, (d + BLOCK - 1) // BLOCK)  # (r, d/B)
        self.cols = hashes.cols
        self.rows = hashes.rows
        # int32 indices for index_select: half the cache of int64 and faster on CPU (entries
        # are < 2c <= 2^31 − 2 since cols < 2^30 is checked); scatter_add_ takes int64 only
        # and is a third faster on CPU than index_add_ with either (the same serial sums)
        self.low = low.to(torch.int32).to(device)
        # CPU only: the other devices' path computes positions from ``low`` and ``high``
        self.low64 = low if device.type == "cpu" else low[:, :0]
        self.high = high.to(device)
        self.high_list: list[list[int]] = high.tolist()  # window offsets for the CPU loops
        # row j of the flattened 4c-wide scratch table starts at j·4c
        self.row_starts = torch.arange(self.rows, dtype=torch.int64, device=device).view(-1, 1)
        self.row_starts.mul_(4 * self.cols)

    def positions(self, i: torch.Tensor) -> torch.Tensor:
        """Positions H_j(i div B) + L_j(i mod B) in [0, 4c) of coordinates ``i``: (r, n) int64.

        Position p stands for q = p mod 2c, i.e. bucket p mod c with sign −1 when p div c is
        odd (see the module docstring).
        """
        return self.high[:, i >> LOW_BITS] + self.low[:, i & (BLOCK - 1)]  # int64

    def buckets_and_signs(self, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buckets (r, n) int64 in [0, c) and signs (r, n) float32 (±1) of coordinates ``i``."""
        pos = self.positions(i)
        sign = (pos // self.cols).bitwise_and_(1).to(torch.float32).mul_(-2.0).add_(1.0)
        return pos.remainder_(self.cols), sign


@functools.lru_cache(maxsize=16)
def _hash_tables(hashes: SketchHashes, d: int, device: torch.device) -> _HashTables:
    # A sketch is rebuilt from its seed every round by FetchSGD's sites and server; caching
    # the tables (a few MB at most) spares recomputing r·(B + d/B) remainders each time.
    return _HashTables(hashes, d, device)


def _fold_quarters(scratch: torch.Tensor, cols: int) -> torch.Tensor:
    """(r, 4c) scratch → (r, c) table: Q0 − Q1 + Q2 − Q3."""
    quarters = scratch.view(scratch.shape[0], 4, cols)
    return (quarters[:, 0] - quarters[:, 1]) + (quarters[:, 2] - quarters[:, 3])


def _median_over_rows(v: torch.Tensor) -> torch.Tensor:
    """Median along dim 0 of an (r, n) tensor with odd r; returns (n,); ``v`` is kept.

    ``torch.median(dim=0)`` runs at about 1% of memory bandwidth on CPU and is not
    deterministic on CUDA; min/max networks for r <= 5 and a sort otherwise give the same
    element (the middle one) much faster.
    """
    r = v.shape[0]
    if r == 1:
        return v[0]
    if r in (3, 5):
        scratch = v.new_empty(r + 1, v.shape[1])  # the network overwrites its input
        scratch[:r] = v
        out = v.new_empty(v.shape[1])
        _median_over_rows_into(scratch, out)
        return out
    return torch.sort(v, dim=0).values[r // 2]


def _median_over_rows_into(v: torch.Tensor, out: torch.Tensor) -> None:
    """Write the median of rows 0..r−1 of an (r + 1, n) scratch tensor into ``out`` (n,).

    Same element as ``_median_over_rows(v[:-1])``. For r = 3 and 5 the min/max network
    allocates nothing: its intermediate results overwrite the votes, and row r is its one
    extra scratch row; other r fall back to ``_median_over_rows``.
    """
    r = v.shape[0] - 1
    if r == 3:
        a, b, c, t = v.unbind(0)
        torch.minimum(a, b, out=t)
        torch.maximum(a, b, out=a)  # t = lo_ab, a = hi_ab
        torch.minimum(a, c, out=a)
        torch.maximum(t, a, out=out)  # median3 = max(lo_ab, min(hi_ab, c))
        return
    if r == 5:
        # min(lo_ab, lo_cd) has three elements >= it, max(hi_ab, hi_cd) three <= it: one lies
        # below the median and one above, so dropping both leaves the median of the other three
        a, b, c, d, e, t = v.unbind(0)
        torch.minimum(a, b, out=t)
        torch.maximum(a, b, out=a)  # t = lo_ab, a = hi_ab
        torch.minimum(c, d, out=b)
        torch.maximum(c, d, out=c)  # b = lo_cd, c = hi_cd
        torch.maximum(t, b, out=t)  # max(lo_ab, lo_cd)
        torch.minimum(a, c, out=a)  # min(hi_ab, hi_cd)
        torch.minimum(t, a, out=b)  # then the median of t, a and e, as for r = 3
        torch.maximum(t, a, out=c)
        torch.minimum(c, e, out=c)
        torch.maximum(b, c, out=out)
        return
    out.copy_(_median_over_rows(v[:-1]))


@dataclass(frozen=True)
class _Piece:
    """Coordinates [start, stop) inside one block: low halves [start − base, stop − base)."""

    block: int
    start: int
    stop: int

    @property
    def low_start(self) -> int:
        return self.start - self.block * BLOCK

    @property
    def low_stop(self) -> int:
        return self.stop - self.block * BLOCK


def _pieces(start: int, stop: int, chunk: int) -> Iterator[_Piece]:
    """[start, stop) cut at every block boundary and into pieces of at most ``chunk``."""
    while start < stop:
        block = start // BLOCK
        piece_stop = min(stop, (block + 1) * BLOCK, start + chunk)
        yield _Piece(block, start, piece_stop)
        start = piece_stop


@dataclass(frozen=True)
class CountSketch:
    """A count sketch of vectors of dimension d with the given hashes.

    Parameters
    ----------
    d : int
        Dimension of the sketched vectors, 0 < d < 2^31.
    hashes : SketchHashes
        Row count r (odd), column count c and hash parameters; usually
        ``CountSketch.from_seed`` builds them.
    chunk : int
        Coordinates per pass: estimation's temporary votes are r × chunk floats (on CPU passes
        are cut further at block boundaries). Results do not depend on it.

    Notes
    -----
    Tables are float32 tensors of shape (r, c) on the device of the caller's tensors; the
    sketch holds no tensors itself, so one object serves CPU and CUDA. Sketching uses a
    scratch table of r × 4c floats.
    """

    d: int
    hashes: SketchHashes
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        require(_positive_int("d", self.d), _positive_int("chunk", self.chunk))
        if self.d >= MAX_DIM:
            raise ConfigError(
                f"count sketch d must be < 2^31 (int32 coordinates), got d = {self.d}"
            )

    @classmethod
    def from_seed(
        cls, d: int, *, rows: int, cols: int, seed: int, chunk: int = DEFAULT_CHUNK
    ) -> CountSketch:
        """Build a sketch whose hashes derive from ``seed`` (identical in every process)."""
        return cls(d=d, hashes=SketchHashes.from_seed(seed, rows, cols), chunk=chunk)

    @property
    def rows(self) -> int:
        """Number of rows r."""
        return self.hashes.rows

    @property
    def cols(self) -> int:
        """Number of columns c."""
        return self.hashes.cols

    def _tables(self, device: torch.device) -> _HashTables:
        return _hash_tables(self.hashes, self.d, device)

    def hash_range(
        self, start: int, stop: int, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Buckets h_j(i) and signs s_j(i) of coordinates start <= i < stop.

        Returns
        -------
        buckets : torch.Tensor
            (r, stop − start) int64 in [0, c).
        signs : torch.Tensor
            (r, stop − start) float32, each +1 or −1.
        """
        if not 0 <= start <= stop <= self.d:
            raise ValueError(f"need 0 <= start <= stop <= d = {self.d}, got [{start}, {stop})")
        dev = torch.device(device or "cpu")
        i = torch.arange(start, stop, dtype=torch.int64, device=dev)  # (n,)
        return self._tables(dev).buckets_and_signs(i)

    def buckets_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Buckets h_j(i) ((r, n) int64 in [0, c)) of the coordinates ``indices`` ((n,))."""
        i = indices.to(torch.int64)
        if i.numel() and not (int(i.min()) >= 0 and int(i.max()) < self.d):
            raise ValueError(f"coordinates must be in [0, {self.d})")
        buckets, _ = self._tables(indices.device).buckets_and_signs(i)
        return buckets

    # ------------------------------------------------------------------ building tables
    def zeros(self, device: torch.device | str | None = None) -> torch.Tensor:
        """An empty (r, c) float32 table on ``device`` (CPU by default)."""
        return torch.zeros(self.rows, self.cols, dtype=torch.float32, device=device)

    def sketch(self, vector: torch.Tensor) -> torch.Tensor:
        """Return S(vector): a new (r, c) float32 table on the vector's device."""
        return self.accumulate(self.zeros(vector.device), vector)

    def accumulate(self, table: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        """Add S(vector) into ``table`` in place and return it (S is linear).

        Parameters
        ----------
        table : torch.Tensor
            (r, c) float32, contiguous; modified in place.
        vector : torch.Tensor
            (d,) on the table's device; cast to float32.
        """
        self._check_table(table)
        vector = self._check_vector(vector, table.device)
        tables = self._tables(table.device)
        scratch = torch.zeros(self.rows, 4 * self.cols, dtype=torch.float32, device=table.device)
        if table.device.type == "cpu":
            self._scatter_by_blocks(scratch, vector, tables)
        else:
            self._scatter_by_positions(scratch, vector, tables, self.chunk)
        table.add_(_fold_quarters(scratch, self.cols))
        return table

    def _scatter_by_blocks(
        self, scratch: torch.Tensor, vector: torch.Tensor, tables: _HashTables
    ) -> None:
        """CPU: one scatter_add_ per row and piece, into the window the piece's block selects.

        Rows outermost, so one row's 4c scratch stays in cache while every block adds to it;
        within a row, blocks in order of their window's offset, so consecutive windows overlap
        (about 6% faster at d = 50M than block order; the sum order is still fixed).
        """
        span = 2 * self.cols
        pieces = list(_pieces(0, self.d, self.chunk))
        for j in range(self.rows):
            row, low, high = scratch[j], tables.low64[j], tables.high_list[j]
            for p in sorted(pieces, key=lambda piece: high[piece.block]):
                offset = high[p.block]
                row[offset : offset + span].scatter_add_(
                    0, low[p.low_start : p.low_stop], vector[p.start : p.stop]
                )

    def _scatter_by_positions(
        self, scratch: torch.Tensor, vector: torch.Tensor, tables: _HashTables, chunk: int
    ) -> None:
        """Any device: positions computed by gathers for ``chunk`` coordinates at a time.

        Fewer, larger kernels than ``_scatter_by_blocks`` (CUDA's launches cost more than its
        arithmetic); same positions, so the same table up to float summation order.
        """
        flat = scratch.view(-1)
        for start in range(0, self.d, chunk):
            stop = min(start + chunk, self.d)
            i = torch.arange(start, stop, dtype=torch.int64, device=scratch.device)  # (n,)
            pos = tables.positions(i).add_(tables.row_starts)  # (r, n) flat positions
            values = vector[start:stop].expand(self.rows, -1)  # (r, n) view, no copy
            flat.index_add_(0, pos.view(-1), values.reshape(-1))

    # ------------------------------------------------------------------ querying tables
    def estimate(self, table: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Estimate every coordinate: median over rows of s_j(i)·T[j, h_j(i)].

        Parameters
        ----------
        table : torch.Tensor
            (r, c) float32 table.
        chunk : int, optional
            Coordinates per pass (default: the sketch's ``chunk``); bounds the votes
            buffer, (r + 1) × chunk floats on CPU, (r, chunk) tensors per pass elsewhere.
            Results do not depend on it.

        Returns
        -------
        torch.Tensor
            (d,) float32 on the table's device.
        """
        self._check_table(table)
        step = self.chunk if chunk is None else chunk
        require(_positive_int("chunk", step))
        tables = self._tables(table.device)
        # s·T[h] at every position p of [0, 4c): quarters 1 and 3 carry the negative sign
        signed = torch.cat((table, -table, table, -table), dim=1)  # (r, 4c)
        out = torch.empty(self.d, dtype=torch.float32, device=table.device)  # (d,)
        if table.device.type == "cpu":
            self._gather_by_blocks(signed, out, tables, step)
        else:
            self._gather_by_positions(signed, out, tables, step)
        return out

    def _gather_by_blocks(
        self, signed: torch.Tensor, out: torch.Tensor, tables: _HashTables, chunk: int
    ) -> None:
        """CPU: per pass, one index_select per row and block from the block's window.

        Rows outermost within a pass, as in sketching: one row's window stays in cache. The
        votes and the median's one scratch row are allocated once per call and reused by every
        pass: fresh temporaries per pass cost about 13k page faults per call at d = 1M
        whenever the allocator hands them back to the OS in between (35 ms instead of 10).
        """
        span = 2 * self.cols
        width = min(chunk, self.d)
        votes = torch.empty(self.rows + 1, width, dtype=torch.float32)  # (r + 1, chunk)
        for start in range(0, self.d, chunk):
            stop = min(start + chunk, self.d)
            pieces = list(_pieces(start, stop, chunk))
            for j in range(self.rows):
                row, low, high, row_votes = signed[j], tables.low[j], tables.high_list[j], votes[j]
                for p in pieces:
                    offset = high[p.block]
                    torch.index_select(
                        row[offset : offset + span],
                        0,
                        low[p.low_start : p.low_stop],
                        out=row_votes[p.start - start : p.stop - start],
                    )
            _median_over_rows_into(votes[:, : stop - start], out[start:stop])

    def _gather_by_positions(
        self, signed: torch.Tensor, out: torch.Tensor, tables: _HashTables, chunk: int
    ) -> None:
        for start in range(0, self.d, chunk):
            stop = min(start + chunk, self.d)
            i = torch.arange(start, stop, dtype=torch.int64, device=signed.device)  # (n,)
            votes = signed.gather(1, tables.positions(i))  # (r, n)
            out[start:stop] = _median_over_rows(votes)

    def norm_estimate(self, table: torch.Tensor) -> torch.Tensor:
        """Estimate ‖g‖² (the squared norm, not the norm) of the sketched vector.

        Each row's Σ_b T[j, b]² is an unbiased estimate of ‖g‖²; the median over rows resists
        rows with an unlucky collision. Returns a 0-dim float32 tensor on the table's device.
        """
        self._check_table(table)
        per_row = table.square().sum(dim=1)  # (r,)
        return _median_over_rows(per_row.view(-1, 1)).view(())

    def top_k(
        self,
        table: torch.Tensor,
        k: int,
        chunk: int | None = None,
        excluded: Sequence[tuple[int, int]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k coordinates with the largest estimated magnitude, none in the ``excluded``
        ranges ``[start, stop)``: one of theirs picked for want of k nonzero others is
        dropped, so fewer than k may come back then.

        Returns
        -------
        indices : torch.Tensor
            (k,) int64 (or fewer, see above), ordered by decreasing |estimate|.
        values : torch.Tensor
            float32, the signed estimates at ``indices``.
        """
        require(_positive_int("k", k))
        if k > self.d:
            raise ConfigError(f"top-k needs k <= d = {self.d}, got k = {k}")
        est = self.estimate(table, chunk=chunk)  # (d,)
        for start, stop in excluded:
            est[start:stop] = 0.0
        indices = top_k_largest(est.abs(), k)  # (k,)
        if excluded:  # a zero estimate of theirs picked for want of k others
            outside = torch.ones_like(indices, dtype=torch.bool)
            for start, stop in excluded:
                outside &= (indices < start) | (indices >= stop)
            indices = indices[outside]
        return indices, est[indices]

    # ------------------------------------------------------------------ validation
    def _check_table(self, table: torch.Tensor) -> None:
        if table.shape != (self.rows, self.cols) or table.dtype != torch.float32:
            raise ValueError(
                f"table must be float32 of shape ({self.rows}, {self.cols}), "
                f"got {table.dtype} {tuple(table.shape)}"
            )
        if not table.is_contiguous():
            raise ValueError("table must be contiguous (it is updated through a flat view)")

    def _check_vector(self, vector: torch.Tensor, device: torch.device) -> torch.Tensor:
        if vector.dim() != 1 or vector.shape[0] != self.d:
            raise ValueError(f"vector must have shape ({self.d},), got {tuple(vector.shape)}")
        if vector.device != device:
            raise ValueError(f"vector is on {vector.device} but the table is on {device}")
        return vector.to(torch.float32)


def sketch_device() -> torch.device:
    """CUDA when present, else the CPU: where sites sketch and servers query their tables
    (sketching or estimating d coordinates is each side's heavy step)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def top_k_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of a 1-D tensor, largest first (as ``torch.topk``).

    ``torch.topk`` over millions of entries on CPU takes as long as sketching them. Like
    ``strategies.top_k.top_k_by_magnitude``, it guesses a threshold from a sample first. Here a
    strided sample sets a threshold with about 2k entries above it; one comparison pass keeps
    those, and ``torch.topk`` runs on them only. Exact: when at least k entries reach the
    threshold, every entry of the true top k is among them; otherwise (an unlucky sample)
    it falls back to ``torch.topk`` over everything. NaN entries never pass the threshold,
    so callers keep tables finite (the strategies reject non-finite uploads).
    """
    n = values.numel()
    if n <= LARGEST_SAMPLE or 4 * k > n:
        return torch.topk(values, k, sorted=True).indices
    sample = values[:: n // LARGEST_SAMPLE]  # strided view, deterministic
    m = sample.numel()
    expected_above = min(m - 1, 2 * k * m // n + 8)  # sample entries above the threshold
    threshold = torch.kthvalue(sample, m - expected_above).values
    candidates = torch.nonzero(values >= threshold).view(-1)  # (≈2k,) ascending
    if candidates.numel() < k:
        return torch.topk(values, k, sorted=True).indices
    return candidates[torch.topk(values[candidates], k, sorted=True).indices]
