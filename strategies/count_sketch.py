"""Count sketch of a d-dimensional vector: an r × c table, hashes computed on the fly.

Pure torch; imports no Flower. ALGORITHMS.md §3: row j has a bucket hash h_j: [d] → [c] and a
sign hash s_j: [d] → {±1}; sketching adds s_j(i)·g_i into T[j, h_j(i)]. The sketch is linear,
so tables from many sites can be added (or averaged) and momentum and error feedback can run on
tables. Estimate of g_i: the median over rows of s_j(i)·T[j, h_j(i)].

Hashes are the pairwise-independent family over the Mersenne prime p = 2^31 − 1::

    h_j(i) = ((a_j·i + b_j) mod p) mod c
    s_j(i) = 1 − 2·(((a'_j·i + b'_j) mod p) & 1)

with (a, b) and (a', b') drawn from ``derive_seed(seed, "count-sketch", j, ...)``, so every site
and the server build identical hashes from the seed sent in the round config, in any process
and on any device. With i < 2^31 and a, b < p, a·i + b < 2^62 + 2^31 fits int64: a well-known
library computes this product in a range that overflows and leaves most buckets of a row unused.

No r × d index tables are stored: indices are recomputed per chunk of coordinates, which bounds
the working memory to O(r · chunk) whatever d is.

Determinism: on CPU every operation is sequential and exact given the inputs. On CUDA
``index_add_`` uses atomic float additions, so the sum order inside a bucket (and hence the last
bits of a table entry) can vary unless ``torch.use_deterministic_algorithms(True)`` is set;
estimation and top-k never use ``torch.median`` along a dim (not deterministic on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flplatform.errors import ConfigError
from flplatform.seeding import derive_seed

P = 2**31 - 1  # Mersenne prime; every hash value is < p
MAX_DIM = 2**31  # i < 2^31 keeps a·i + b < 2^63 (no int64 overflow)
DEFAULT_CHUNK = 1 << 16  # coordinates per chunk: r·chunk int64 indices stay in L2 cache
HASH_TAG = "count-sketch"


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"count sketch {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class SketchHashes:
    """Hash parameters of an r-row count sketch with c columns.

    Parameters
    ----------
    cols : int
        Number of buckets c per row.
    bucket_a, bucket_b : tuple of int
        Per-row (a_j, b_j) of the bucket hash; 1 <= a_j < p, 0 <= b_j < p.
    sign_a, sign_b : tuple of int
        Per-row (a'_j, b'_j) of the sign hash, drawn independently of the bucket pair.

    Notes
    -----
    The number of rows r = len(bucket_a) must be odd, so the median over rows is one element
    (no averaging of two middle values, which would mix two collisions).
    """

    cols: int
    bucket_a: tuple[int, ...]
    bucket_b: tuple[int, ...]
    sign_a: tuple[int, ...]
    sign_b: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_positive("cols", self.cols)
        rows = len(self.bucket_a)
        _check_positive("rows", rows)
        if rows % 2 == 0:
            raise ConfigError(f"count sketch rows must be odd (median of one element), got {rows}")
        for name in ("bucket_b", "sign_a", "sign_b"):
            if len(getattr(self, name)) != rows:
                raise ConfigError(f"count sketch {name} must have {rows} entries like bucket_a")
        for name in ("bucket_a", "sign_a"):
            if not all(1 <= int(a) < P for a in getattr(self, name)):
                raise ConfigError(f"count sketch {name} entries must be in [1, 2^31 - 1)")
        for name in ("bucket_b", "sign_b"):
            if not all(0 <= int(b) < P for b in getattr(self, name)):
                raise ConfigError(f"count sketch {name} entries must be in [0, 2^31 - 1)")

    @classmethod
    def from_seed(cls, seed: int, rows: int, cols: int) -> SketchHashes:
        """Derive the hashes of row j from ``derive_seed(seed, "count-sketch", j, part)``."""
        _check_positive("rows", rows)

        def draw(j: int, part: str, low: int) -> int:
            # low = 1 for multipliers (a = 0 would send every coordinate to one bucket)
            return low + derive_seed(seed, HASH_TAG, j, part) % (P - low)

        return cls(
            cols=cols,
            bucket_a=tuple(draw(j, "bucket-a", 1) for j in range(rows)),
            bucket_b=tuple(draw(j, "bucket-b", 0) for j in range(rows)),
            sign_a=tuple(draw(j, "sign-a", 1) for j in range(rows)),
            sign_b=tuple(draw(j, "sign-b", 0) for j in range(rows)),
        )

    @property
    def rows(self) -> int:
        """Number of rows r."""
        return len(self.bucket_a)


class _DeviceHashes:
    """The hash parameters as (r, 1) int64 tensors on one device, built once per call."""

    def __init__(self, hashes: SketchHashes, device: torch.device) -> None:
        def col(values: tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device).view(-1, 1)

        self.bucket_a, self.bucket_b = col(hashes.bucket_a), col(hashes.bucket_b)
        self.sign_a, self.sign_b = col(hashes.sign_a), col(hashes.sign_b)
        self.cols = hashes.cols
        # row j lives at [j·c, (j+1)·c) of the flattened table
        self.offsets = torch.arange(hashes.rows, dtype=torch.int64, device=device).view(-1, 1)
        self.offsets.mul_(hashes.cols)

    def flat_index_and_sign(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat table indices (r, n) int64 and signs (r, n) float32 of coordinates [start, stop)."""
        i = torch.arange(start, stop, dtype=torch.int64, device=self.offsets.device)  # (n,)
        return self.flat_index_and_sign_of(i)

    def flat_index_and_sign_of(self, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``flat_index_and_sign`` for the coordinates ``i`` ((n,) int64, any order)."""
        x = self.bucket_a * i  # (r, n); < 2^62 since a < 2^31 and i < 2^31
        x.add_(self.bucket_b).remainder_(P).remainder_(self.cols).add_(self.offsets)
        y = self.sign_a * i  # (r, n)
        y.add_(self.sign_b).remainder_(P).bitwise_and_(1)
        sign = y.to(torch.float32).mul_(-2.0).add_(1.0)  # bit 0 → +1, bit 1 → −1
        return x, sign


def _median_over_rows(v: torch.Tensor) -> torch.Tensor:
    """Median along dim 0 of an (r, n) tensor with odd r; returns (n,).

    ``torch.median(dim=0)`` runs at about 1% of memory bandwidth on CPU and is not
    deterministic on CUDA; min/max networks for r <= 5 and a sort otherwise give the same
    element (the middle one) much faster.
    """
    r = v.shape[0]
    if r == 1:
        return v[0]
    if r == 3:
        return _median3(v[0], v[1], v[2])
    if r == 5:
        a, b, c, d, e = v.unbind(0)
        lo_ab, hi_ab = torch.minimum(a, b), torch.maximum(a, b)
        lo_cd, hi_cd = torch.minimum(c, d), torch.maximum(c, d)
        # min(lo_ab, lo_cd) has three elements >= it, max(hi_ab, hi_cd) three <= it: one lies
        # below the median and one above, so dropping both leaves the median of the other three
        return _median3(torch.maximum(lo_ab, lo_cd), torch.minimum(hi_ab, hi_cd), e)
    return torch.sort(v, dim=0).values[r // 2]


def _median3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))


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
        Coordinates hashed at a time. Working memory is about r·chunk·(8 + 4 + 4) bytes;
        the default keeps it in cache. Results do not depend on it.

    Notes
    -----
    Tables are float32 tensors of shape (r, c) on the device of the caller's tensors; the
    sketch holds no tensors itself, so one object serves CPU and CUDA.
    """

    d: int
    hashes: SketchHashes
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        _check_positive("d", self.d)
        _check_positive("chunk", self.chunk)
        if self.d >= MAX_DIM:
            raise ConfigError(
                f"count sketch d must be < 2^31 so a·i + b fits int64, got d = {self.d}"
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
        dev = _DeviceHashes(self.hashes, torch.device(device or "cpu"))
        index, sign = dev.flat_index_and_sign(start, stop)
        return index.sub_(dev.offsets), sign

    def buckets_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Buckets h_j(i) ((r, n) int64 in [0, c)) of the coordinates ``indices`` ((n,))."""
        dev = _DeviceHashes(self.hashes, indices.device)
        index, _ = dev.flat_index_and_sign_of(indices.to(torch.int64))
        return index.sub_(dev.offsets)

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
        flat = table.view(-1)  # (r·c,)
        dev = _DeviceHashes(self.hashes, table.device)
        for start in range(0, self.d, self.chunk):
            stop = min(start + self.chunk, self.d)
            index, sign = dev.flat_index_and_sign(start, stop)  # (r, n), (r, n)
            source = sign.mul_(vector[start:stop])  # (r, n): s_j(i)·g_i
            # one call per chunk for all rows: fewer kernel launches than r calls
            flat.index_add_(0, index.view(-1), source.view(-1))
        return table

    # ------------------------------------------------------------------ querying tables
    def estimate(self, table: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Estimate every coordinate: median over rows of s_j(i)·T[j, h_j(i)].

        Parameters
        ----------
        table : torch.Tensor
            (r, c) float32 table.
        chunk : int, optional
            Coordinates per gather (default: the sketch's ``chunk``); bounds the temporary
            (r, chunk) tensors. Results do not depend on it.

        Returns
        -------
        torch.Tensor
            (d,) float32 on the table's device.
        """
        self._check_table(table)
        step = self.chunk if chunk is None else chunk
        _check_positive("chunk", step)
        flat = table.reshape(-1)  # (r·c,)
        dev = _DeviceHashes(self.hashes, table.device)
        out = torch.empty(self.d, dtype=torch.float32, device=table.device)  # (d,)
        for start in range(0, self.d, step):
            stop = min(start + step, self.d)
            index, sign = dev.flat_index_and_sign(start, stop)  # (r, n), (r, n)
            votes = sign.mul_(flat[index])  # (r, n)
            out[start:stop] = _median_over_rows(votes)
        return out

    def norm_estimate(self, table: torch.Tensor) -> torch.Tensor:
        """Estimate ‖g‖² (the squared norm, not the norm) of the sketched vector.

        Each row's Σ_b T[j, b]² is an unbiased estimate of ‖g‖²; the median over rows resists
        rows with an unlucky collision. Returns a 0-dim float32 tensor on the table's device.
        """
        self._check_table(table)
        per_row = table.square().sum(dim=1)  # (r,)
        return _median_over_rows(per_row.view(-1, 1)).view(())

    def top_k(
        self, table: torch.Tensor, k: int, chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k coordinates with the largest estimated magnitude.

        Returns
        -------
        indices : torch.Tensor
            (k,) int64, ordered by decreasing |estimate|.
        values : torch.Tensor
            (k,) float32, the signed estimates at ``indices``.
        """
        _check_positive("k", k)
        if k > self.d:
            raise ConfigError(f"top-k needs k <= d = {self.d}, got k = {k}")
        est = self.estimate(table, chunk=chunk)  # (d,)
        indices = torch.topk(est.abs(), k, sorted=True).indices  # (k,)
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
