"""Row kernels of the staleness window's weight prediction (worker/updates/staleness.py).

Two operations the prediction does every step, each one pass over the rows with the
native kernels (hybridps/native/fused_adam.c) and the same float32 results as the torch
ops they replace (the torch versions are the fallback and the tests' reference):

- `apply_update_measured_`: apply an update (rows[ids] = rows[ids] * decay + delta) and
  return what it changed, new - old: the prediction's "effective update". In torch that
  is a gather before, the update, a gather after and a subtraction.
- `add_offsets_`: add to gathered rows the offsets of those among them that have one
  (keys sorted): a search, a compare, two gathers and a `where` in torch.
- `pick_offsets`: the rows of a sorted table of deltas for some ids, 0 for the ids it
  lacks, and how many it had: the prediction at K=1 (a search, a compare, a gather and a
  `where` in torch).
"""

from __future__ import annotations

import torch

from hybridps.optim import apply_update_, is_cpu_f32, kernel_threads, native_in_use


def _native_ids(ids: torch.Tensor) -> bool:
    return ids.is_cpu and ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()


def apply_update_measured_(rows_RD: torch.Tensor, local_U: torch.Tensor,
                           delta_UD: torch.Tensor, decay: float) -> torch.Tensor:
    """rows[local_U] = rows[local_U] * decay + delta (local_U unique, in range); returns
    effect_UD = the new rows - the old rows, float32."""
    ext = native_in_use()
    if ext is not None and is_cpu_f32(rows_RD) and rows_RD.dim() == 2 and _native_ids(local_U):
        n, dim = rows_RD.shape
        delta = delta_UD.to(dtype=torch.float32).contiguous()
        if delta.shape == (local_U.numel(), dim):
            effect_UD = torch.empty(local_U.numel(), dim, dtype=torch.float32)
            ext.apply_update(rows_RD.data_ptr(), n, dim, local_U.data_ptr(), local_U.numel(),
                             delta.data_ptr(), float(decay), kernel_threads(),
                             effect_UD.data_ptr())
            return effect_UD
    before_UD = rows_RD.index_select(0, local_U).float()
    apply_update_(rows_RD, local_U, delta_UD, decay)
    return rows_RD.index_select(0, local_U).float() - before_UD


def add_offsets_(rows_MD: torch.Tensor, ids_M: torch.Tensor, keys_P: torch.Tensor,
                 offset_PD: torch.Tensor) -> torch.Tensor:
    """rows_MD[m] + offset_PD[p] where ids_M[m] == keys_P[p], rows_MD[m] elsewhere.

    keys_P sorted and distinct. In place on rows_MD when the native kernel runs (so
    rows_MD must be a tensor of the caller's own: a fresh gather), a new tensor
    otherwise; use the result."""
    ext = native_in_use()
    if (ext is not None and is_cpu_f32(rows_MD) and rows_MD.dim() == 2
            and is_cpu_f32(offset_PD) and _native_ids(ids_M) and _native_ids(keys_P)
            and offset_PD.shape == (keys_P.numel(), rows_MD.shape[1])
            and ids_M.numel() == rows_MD.shape[0]):
        ext.add_offsets(rows_MD.data_ptr(), rows_MD.shape[0], rows_MD.shape[1],
                        ids_M.data_ptr(), keys_P.data_ptr(), keys_P.numel(),
                        offset_PD.data_ptr())
        return rows_MD
    pos_M = torch.searchsorted(keys_P, ids_M).clamp_(max=keys_P.numel() - 1)
    hit_M1 = (keys_P.index_select(0, pos_M) == ids_M).unsqueeze(1)
    offset_MD = offset_PD.index_select(0, pos_M).to(rows_MD.dtype)
    return rows_MD + torch.where(hit_M1, offset_MD, 0.0)


def pick_offsets(keys_L: torch.Tensor, src_LD: torch.Tensor, ids_N: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | int]:
    """(out_ND, hits): out_ND[n] = src_LD[l] where ids_N[n] == keys_L[l], +0.0 where no key
    is ids_N[n]; hits counts the ids found (an int on the native path, a tensor on the
    rows' device otherwise: its value is not read on the host). keys_L sorted and
    distinct, not empty."""
    ext = native_in_use()
    if (ext is not None and is_cpu_f32(src_LD) and src_LD.dim() == 2 and _native_ids(keys_L)
            and _native_ids(ids_N) and src_LD.shape[0] == keys_L.numel()):
        out_ND = torch.empty(ids_N.numel(), src_LD.shape[1], dtype=torch.float32)
        hits = ext.pick_offsets(ids_N.data_ptr(), ids_N.numel(), keys_L.data_ptr(),
                                keys_L.numel(), src_LD.data_ptr(), src_LD.shape[1],
                                out_ND.data_ptr())
        return out_ND, int(hits)
    pos_N = torch.searchsorted(keys_L, ids_N).clamp_(max=keys_L.numel() - 1)
    hit_N = keys_L.index_select(0, pos_N) == ids_N
    return torch.where(hit_N.unsqueeze(1), src_LD.index_select(0, pos_N), 0.0), hit_N.sum()
