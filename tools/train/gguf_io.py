"""GGUF writing and reading (SPEC 1) and the block quantizers our files use, in numpy.

Quantizers (all return uint8 arrays [rows, row_bytes]):
  PTQ1_0 / PQ2_0 : ternary codes q in {-1,0,1} with one fp16 scale per 128 (SPEC 1.1). The codes and
                   scales come from `ternary_codes` (the same function the training forward uses), so a
                   file holds exactly the weights training computed with.
  Q4_K / Q6_K    : plain (non-searching) quantizers for the drafter; `dequant_*` mirror SPEC 1.1 and
                   are checked against `dflash dump` in tools/train/selftest.py.
  F32 / F16 / BF16.
"""
import struct

import numpy as np

# ggml type ids (SPEC 1.1)
F32, F16, Q4_K, Q6_K, BF16, PQ2_0, PTQ1_0 = 0, 1, 12, 14, 30, 142, 143
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_K: (256, 144), Q6_K: (256, 210), PQ2_0: (128, 34),
         PTQ1_0: (128, 28)}
TYPE_NAMES = {"f32": F32, "f16": F16, "bf16": BF16, "q4_k": Q4_K, "q6_k": Q6_K, "pq2_0": PQ2_0, "ptq1_0": PTQ1_0}

# KV value types
T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 = range(13)
_SCALAR_FMT = {T_U8: "<B", T_I8: "<b", T_U16: "<H", T_I16: "<h", T_U32: "<I", T_I32: "<i", T_F32: "<f",
               T_BOOL: "<B", T_U64: "<Q", T_I64: "<q", T_F64: "<d"}


def _str(s):
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _val(t, v):
    if t == T_STR:
        return _str(v)
    if t == T_BOOL:
        return struct.pack("<B", 1 if v else 0)
    return struct.pack(_SCALAR_FMT[t], v)


class GGUFWriter:
    """Collects KVs and tensors, writes a GGUF v3 file (alignment 32)."""

    def __init__(self):
        self.kv = []  # (key, type, value) ; arrays: type = (T_ARR, elem_type)
        self.tensors = []  # (name, ggml_type, ne list, bytes)

    def add(self, key, vtype, value):
        assert all(k != key for k, _, _ in self.kv), f"duplicate key {key}"
        self.kv.append((key, vtype, value))

    def u32(self, k, v): self.add(k, T_U32, int(v))
    def i32(self, k, v): self.add(k, T_I32, int(v))
    def f32(self, k, v): self.add(k, T_F32, float(v))
    def string(self, k, v): self.add(k, T_STR, v)
    def boolean(self, k, v): self.add(k, T_BOOL, bool(v))
    def array(self, k, et, vals): self.add(k, (T_ARR, et), list(vals))

    def tensor(self, name, gtype, ne, data):
        """ne in ggml order ([in, out]); data: uint8 bytes of the whole tensor (rows of ne[0])."""
        be, bb = BLOCK[gtype]
        assert ne[0] % be == 0, f"{name}: row {ne[0]} not a multiple of block {be}"
        n = int(np.prod(ne))
        want = n // be * bb
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        assert data.size == want, f"{name}: {data.size} bytes, expected {want}"
        assert all(t[0] != name for t in self.tensors), f"duplicate tensor {name}"
        self.tensors.append((name, gtype, list(ne), data))

    def write(self, path):
        out = bytearray()
        out += struct.pack("<IIQQ", 0x46554747, 3, len(self.tensors), len(self.kv))
        for key, vtype, value in self.kv:
            out += _str(key)
            if isinstance(vtype, tuple):
                et = vtype[1]
                out += struct.pack("<IIQ", T_ARR, et, len(value))
                if et == T_STR:
                    for v in value:
                        out += _str(v)
                else:
                    out += np.asarray(value, dtype=np.dtype(_SCALAR_FMT[et])).tobytes()
            else:
                out += struct.pack("<I", vtype) + _val(vtype, value)
        offset = 0
        offsets = []
        for name, gtype, ne, data in self.tensors:
            offsets.append(offset)
            offset += data.size
            offset += (-offset) % 32
        for (name, gtype, ne, data), off in zip(self.tensors, offsets):
            out += _str(name) + struct.pack("<I", len(ne))
            for d in ne:
                out += struct.pack("<Q", d)
            out += struct.pack("<IQ", gtype, off)
        out += b"\x00" * ((-len(out)) % 32)
        with open(path, "wb") as fh:
            fh.write(out)
            pos = 0
            for (name, gtype, ne, data), off in zip(self.tensors, offsets):
                assert pos == off
                fh.write(data.tobytes())
                pos += data.size
                pad = (-pos) % 32
                fh.write(b"\x00" * pad)
                pos += pad


class GGUFReader:
    """Minimal reader: kv dict and tensors as (type, ne, raw bytes)."""

    def __init__(self, path):
        self.buf = memoryview(open(path, "rb").read())
        p = 0
        magic, ver, nt, nkv = struct.unpack_from("<IIQQ", self.buf, p)
        assert magic == 0x46554747, "not a GGUF file"
        p += 24
        self.kv = {}

        def rstr(p):
            (n,) = struct.unpack_from("<Q", self.buf, p)
            return bytes(self.buf[p + 8:p + 8 + n]).decode("utf-8"), p + 8 + n

        def rval(t, p):
            if t == T_STR:
                return rstr(p)
            if t == T_ARR:
                et, n = struct.unpack_from("<IQ", self.buf, p)
                p += 12
                if et == T_STR:
                    vals = []
                    for _ in range(n):
                        v, p = rstr(p)
                        vals.append(v)
                    return vals, p
                dt = np.dtype(_SCALAR_FMT[et])
                return np.frombuffer(self.buf, dt, n, p).copy(), p + n * dt.itemsize
            fmt = _SCALAR_FMT[t]
            return struct.unpack_from(fmt, self.buf, p)[0], p + struct.calcsize(fmt)

        for _ in range(nkv):
            k, p = rstr(p)
            (t,) = struct.unpack_from("<I", self.buf, p)
            p += 4
            self.kv[k], p = rval(t, p)
        self.alignment = int(self.kv.get("general.alignment", 32))
        infos = []
        for _ in range(nt):
            name, p = rstr(p)
            (nd,) = struct.unpack_from("<I", self.buf, p)
            p += 4
            ne = list(struct.unpack_from("<" + "Q" * nd, self.buf, p))
            p += 8 * nd
            gtype, off = struct.unpack_from("<IQ", self.buf, p)
            p += 12
            infos.append((name, gtype, ne, off))
        data0 = p + (-p) % self.alignment
        self.tensors = {}
        for name, gtype, ne, off in infos:
            be, bb = BLOCK[gtype]
            nbytes = int(np.prod(ne)) // be * bb
            self.tensors[name] = (gtype, ne, np.frombuffer(self.buf, np.uint8, nbytes, data0 + off))

    def f32(self, name):
        """Dequantized tensor as float32 numpy, shape reversed ggml ne ([out, in] for a matrix)."""
        gtype, ne, raw = self.tensors[name]
        shape = list(reversed(ne))
        return dequantize(gtype, raw, int(np.prod(ne))).reshape(shape)


# ------------------------------------------------------------------------------------------------
# fp16 helpers

def f16_bytes(x):
    return np.asarray(x, np.float32).astype(np.float16).view(np.uint8).reshape(*np.shape(x), 2)


def bf16_round(x):
    """Round-to-nearest-even float32 -> bf16 bit patterns (uint16)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


# ------------------------------------------------------------------------------------------------
# Ternary (PTQ1_0 / PQ2_0)

def ternary_codes_np(w):
    """Reference quantizer on [rows, n] float32: d = max|w| per 128 (fp16-rounded for the value),
    q = round-half-away(w / d) clamped to -1..1 (SPEC 1.1). Returns (q int8 [rows, n], d fp16 [rows, n/128])."""
    w = np.asarray(w, np.float32)
    rows, n = w.shape
    b = w.reshape(rows, n // 128, 128)
    d = np.abs(b).max(-1)
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0).astype(np.float32)
    x = b * inv[..., None]
    q = np.sign(x) * np.floor(np.abs(x) + 0.5)
    q = np.clip(q, -1, 1).astype(np.int8)
    return q.reshape(rows, n), d.astype(np.float16)


def _pack_trits(codes, count, digits):
    """codes: [..., digits*count] values 0..2, value n*count + m is digit n of byte m."""
    c = codes.reshape(*codes.shape[:-1], digits, count).astype(np.int32)
    v = np.zeros(c.shape[:-2] + (count,), np.int32)
    for n in range(digits):
        v = v * 3 + c[..., n, :]
    if digits == 4:
        v = v * 3
    return ((v * 256 + 242) // 243).astype(np.uint8)


def pack_ptq1_0(q, d):
    """q int8 [rows, n] in -1..1, d fp16 [rows, n/128] -> uint8 [rows, n/128*28]."""
    rows, n = q.shape
    c = (q.reshape(rows, n // 128, 128) + 1).astype(np.int32)
    out = np.zeros((rows, n // 128, 28), np.uint8)
    out[..., 0:16] = _pack_trits(c[..., 0:80], 16, 5)
    out[..., 16:24] = _pack_trits(c[..., 80:120], 8, 5)
    out[..., 24:26] = _pack_trits(c[..., 120:128], 2, 4)
    out[..., 26:28] = np.asarray(d, np.float16).view(np.uint8).reshape(rows, n // 128, 2)
    return out.reshape(rows, -1)


def pack_pq2_0(q, d):
    rows, n = q.shape
    c = (q.reshape(rows, n // 128, 32, 4) + 1).astype(np.uint8)
    qs = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    out = np.zeros((rows, n // 128, 34), np.uint8)
    out[..., 0:2] = np.asarray(d, np.float16).view(np.uint8).reshape(rows, n // 128, 2)
    out[..., 2:34] = qs
    return out.reshape(rows, -1)


def _unpack_trits(b, count, digits):
    b = b.astype(np.uint32)
    outs = []
    for n in range(digits):
        outs.append((((b * (3 ** n)) & 0xFF) * 3) >> 8)
    return np.stack(outs, -2).reshape(*b.shape[:-1], digits * count).astype(np.int32)  # value n*count+m


def dequant_ptq1_0(raw, n):
    blk = raw.reshape(-1, 28)
    q = np.concatenate([_unpack_trits(blk[:, 0:16], 16, 5), _unpack_trits(blk[:, 16:24], 8, 5),
                        _unpack_trits(blk[:, 24:26], 2, 4)], -1) - 1
    d = blk[:, 26:28].copy().view(np.float16).astype(np.float32)
    return (q * d).reshape(-1)[:n].astype(np.float32)


def dequant_pq2_0(raw, n):
    blk = raw.reshape(-1, 34)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)
    qs = blk[:, 2:].astype(np.int32)
    q = np.stack([(qs >> (2 * i)) & 3 for i in range(4)], -1).reshape(-1, 128) - 1
    return (q * d).reshape(-1)[:n].astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Q4_K / Q6_K (drafter)

def _round(x):
    return np.floor(x + 0.5)


def quant_q4_k(w):
    """w [rows, n] -> uint8 [rows, n/256*144]. Per 32: min/max asymmetric; 6-bit sub-scales."""
    w = np.asarray(w, np.float32)
    rows, n = w.shape
    x = w.reshape(-1, 8, 32)
    mn = np.minimum(x.min(-1), 0.0)
    mx = x.max(-1)
    scale = (mx - mn) / 15.0
    mins = -mn
    d = scale.max(-1) / 63.0
    dmin = mins.max(-1) / 63.0
    d16 = d.astype(np.float16).astype(np.float32)
    dm16 = dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(_round(np.where(d16[:, None] > 0, scale / np.where(d16[:, None] > 0, d16[:, None], 1), 0)), 0, 63)
    m = np.clip(_round(np.where(dm16[:, None] > 0, mins / np.where(dm16[:, None] > 0, dm16[:, None], 1), 0)), 0, 63)
    # make sure the rounded min still covers the block minimum (raise m by one if needed)
    eff_scale = d16[:, None] * sc
    eff_min = dm16[:, None] * m
    q = np.where(eff_scale[..., None] > 0, _round((x + eff_min[..., None]) / np.where(eff_scale[..., None] > 0,
                                                                                          eff_scale[..., None], 1)), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    nb = x.shape[0]
    out = np.zeros((nb, 144), np.uint8)
    out[:, 0:2] = d16.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dm16.astype(np.float16).view(np.uint8).reshape(nb, 2)
    s = np.zeros((nb, 12), np.uint8)
    for j in range(4):
        s[:, j] = sc[:, j] & 63
        s[:, j + 4] = m[:, j] & 63
    for j in range(4, 8):
        s[:, j + 4] = (sc[:, j] & 0xF) | ((m[:, j] & 0xF) << 4)
        s[:, j - 4] |= (sc[:, j] >> 4) << 6
        s[:, j] |= (m[:, j] >> 4) << 6
    out[:, 4:16] = s
    qf = q.reshape(nb, 256)
    for c in range(4):
        out[:, 16 + 32 * c:16 + 32 * c + 32] = qf[:, 64 * c:64 * c + 32] | (qf[:, 64 * c + 32:64 * c + 64] << 4)
    return out.reshape(rows, -1)


def dequant_q4_k(raw, n):
    blk = raw.reshape(-1, 144)
    d = blk[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = blk[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    s = blk[:, 4:16].astype(np.int32)
    qs = blk[:, 16:].astype(np.int32)
    sc = np.zeros((blk.shape[0], 8), np.int32)
    m = np.zeros((blk.shape[0], 8), np.int32)
    for j in range(8):
        if j < 4:
            sc[:, j] = s[:, j] & 63
            m[:, j] = s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            m[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    y = np.zeros((blk.shape[0], 256), np.float32)
    for c in range(4):
        lo = qs[:, 32 * c:32 * c + 32] & 0xF
        hi = qs[:, 32 * c:32 * c + 32] >> 4
        y[:, 64 * c:64 * c + 32] = d[:, None] * sc[:, 2 * c, None] * lo - dmin[:, None] * m[:, 2 * c, None]
        y[:, 64 * c + 32:64 * c + 64] = d[:, None] * sc[:, 2 * c + 1, None] * hi - dmin[:, None] * m[:, 2 * c + 1, None]
    return y.reshape(-1)[:n]


def quant_q6_k(w):
    w = np.asarray(w, np.float32)
    rows, n = w.shape
    x = w.reshape(-1, 16, 16)
    amax = np.abs(x).max(-1)
    scale = amax / 31.0
    d = scale.max(-1) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(_round(np.where(d16[:, None] > 0, scale / np.where(d16[:, None] > 0, d16[:, None], 1), 0)), 0, 127)
    eff = d16[:, None] * sc
    L = np.where(eff[..., None] > 0, _round(x / np.where(eff[..., None] > 0, eff[..., None], 1)), 0)
    L = (np.clip(L, -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    nb = L.shape[0]
    out = np.zeros((nb, 210), np.uint8)
    for h in range(2):
        Lh = L[:, 128 * h:128 * h + 128]
        v0, v1, v2, v3 = Lh[:, 0:32], Lh[:, 32:64], Lh[:, 64:96], Lh[:, 96:128]
        out[:, 64 * h:64 * h + 32] = (v0 & 0xF) | ((v2 & 0xF) << 4)
        out[:, 64 * h + 32:64 * h + 64] = (v1 & 0xF) | ((v3 & 0xF) << 4)
        out[:, 128 + 32 * h:128 + 32 * h + 32] = (v0 >> 4) | ((v1 >> 4) << 2) | ((v2 >> 4) << 4) | ((v3 >> 4) << 6)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d16.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return out.reshape(rows, -1)


def dequant_q6_k(raw, n):
    blk = raw.reshape(-1, 210)
    ql = blk[:, 0:128].astype(np.int32)
    qh = blk[:, 128:192].astype(np.int32)
    sc = blk[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blk[:, 208:210].copy().view(np.float16).astype(np.float32)[:, 0]
    y = np.zeros((blk.shape[0], 256), np.float32)
    for h in range(2):
        l_ = ql[:, 64 * h:64 * h + 64]
        hh = qh[:, 32 * h:32 * h + 32]
        q1 = ((l_[:, 0:32] & 0xF) | ((hh & 3) << 4)) - 32
        q2 = ((l_[:, 32:64] & 0xF) | (((hh >> 2) & 3) << 4)) - 32
        q3 = ((l_[:, 0:32] >> 4) | (((hh >> 4) & 3) << 4)) - 32
        q4 = ((l_[:, 32:64] >> 4) | (((hh >> 6) & 3) << 4)) - 32
        for qd, qq in enumerate([q1, q2, q3, q4]):
            for half in range(2):
                j = 8 * h + 2 * qd + half
                y[:, 128 * h + 32 * qd + 16 * half:128 * h + 32 * qd + 16 * half + 16] = \
                    d[:, None] * sc[:, j, None] * qq[:, 16 * half:16 * half + 16]
    return y.reshape(-1)[:n]


def quantize(gtype, w):
    """w [rows, n] float32 -> uint8 bytes [rows, row_bytes]."""
    w = np.asarray(w, np.float32)
    if gtype == F32:
        return w.view(np.uint8).reshape(w.shape[0], -1)
    if gtype == F16:
        return w.astype(np.float16).view(np.uint8).reshape(w.shape[0], -1)
    if gtype == BF16:
        return bf16_round(w).view(np.uint8).reshape(w.shape[0], -1)
    if gtype == Q4_K:
        return quant_q4_k(w)
    if gtype == Q6_K:
        return quant_q6_k(w)
    if gtype in (PTQ1_0, PQ2_0):
        q, d = ternary_codes_np(w)
        return pack_ptq1_0(q, d) if gtype == PTQ1_0 else pack_pq2_0(q, d)
    raise ValueError(gtype)


def dequantize(gtype, raw, n):
    raw = np.asarray(raw, np.uint8)
    if gtype == F32:
        return raw.view(np.float32)[:n].copy()
    if gtype == F16:
        return raw.view(np.float16)[:n].astype(np.float32)
    if gtype == BF16:
        return (raw.view(np.uint16)[:n].astype(np.uint32) << 16).view(np.float32)
    if gtype == Q4_K:
        return dequant_q4_k(raw, n)
    if gtype == Q6_K:
        return dequant_q6_k(raw, n)
    if gtype == PTQ1_0:
        return dequant_ptq1_0(raw, n)
    if gtype == PQ2_0:
        return dequant_pq2_0(raw, n)
    raise ValueError(gtype)
