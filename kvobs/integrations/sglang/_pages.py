"""SGLang's KV indices in the form the observer reads, and SGLang's device pools as pages kvobs can check.

SGLang addresses KV two ways: HiCache passes token-slot indices (`device_indices`, one per token; a page is
`page_size` slots), the PD sender and receiver pass page indices. An observer built with `page_size` reads
ids as token slots, one built without it reads them as page ids; `PageIds` turns either SGLang form into
what the observer expects, so both integrations work with either observer.

SGLang's MHA pool keeps one tensor per layer for K and one for V, shaped [size + page_size, heads, dim] and
indexed by token slot (the first page is padding); the MLA pool one `kv_buffer` per layer. Viewed as
[pages, page_size, ...] they are indexed by page, which is what kvobs's NaN/Inf check reads. Other layouts
(HND, which folds heads into the page index; ROCm's vectorized 5-D) are left unchecked, with the reason.
"""

from __future__ import annotations

from typing import Any

from kvobs.integrations._common import checkable, int_list


class PageIds:
    """Converts SGLang's token slots or pages into the ids the observer reads (slots with `page_size`)."""

    def __init__(self, observer_page_size: int | None, engine_page_size: int) -> None:
        if observer_page_size is not None and observer_page_size != engine_page_size:
            raise ValueError(
                f"the observer's page_size={observer_page_size} is not SGLang's page size {engine_page_size}: "
                f"build the observer with page_size={engine_page_size} (or without page_size)"
            )
        self.slots = observer_page_size is not None
        self.page_size = engine_page_size

    def from_slots(self, slots: Any) -> Any:
        """Token slots (a tensor or list) as the observer's ids: unchanged, or their distinct pages."""
        if self.slots:
            return slots
        size = self.page_size
        return sorted({s // size for s in int_list(slots)})

    def from_pages(self, pages: Any) -> Any:
        """Page ids as the observer's ids: unchanged, or the first token slot of each page."""
        if not self.slots:
            return pages
        size = self.page_size
        return [p * size for p in int_list(pages)]


def page_views(pool: Any, page_size: int) -> tuple[list[Any] | None, str]:
    """(the pool's KV tensors viewed as [pages, page_size, ...], or None; why not) for an SGLang device pool
    (MHA: `k_buffer`/`v_buffer`, MLA: `kv_buffer`), or a list of tensors already indexed by page."""
    if isinstance(pool, (list, tuple)):
        return list(pool), ""
    layout = getattr(pool, "kv_cache_layout", None)
    if layout not in (None, "nhd"):
        return None, f"the {layout!r} KV layout is not indexed by token slot (only 'nhd' is)"
    buffers = [t for name in ("k_buffer", "v_buffer", "kv_buffer") for t in (getattr(pool, name, None) or ())]
    if not buffers:
        return None, f"{type(pool).__name__} has no k_buffer/v_buffer/kv_buffer tensors"
    views = []
    for tensor in buffers:
        rows = tensor.shape[0]
        if rows % page_size or not tensor.is_contiguous():
            return None, f"a KV tensor of shape {tuple(tensor.shape)} is not contiguous pages of {page_size} slots"
        views.append(tensor.view(rows // page_size, page_size, *tensor.shape[1:]))
    return checkable(views)


def host_page_views(host_pool: Any, page_size: int) -> tuple[list[Any] | None, str]:
    """(an SGLang host pool's KV viewed as [pages, page_size, ...] per layer, or None; why not). The MHA host
    pool keeps K and V as one tensor each (the MLA pool one `kv_buffer`), [layers, slots, ...] in its
    "layer_first" layout (its `kv_buffer` holding both is not read twice); a hybrid
    controller's `HostPoolGroup` is read through its anchor entry. Other layouts are left unchecked."""
    anchor = getattr(host_pool, "anchor_entry", None)
    pool = anchor.host_pool if anchor is not None else host_pool
    layout = getattr(pool, "layout", None)
    if layout != "layer_first":
        return None, f"the host {layout!r} layout is not indexed by token slot per layer (only 'layer_first' is)"
    views = []
    names = ("k_buffer", "v_buffer") if getattr(pool, "k_buffer", None) is not None else ("kv_buffer",)  # MHA, MLA
    for name in names:
        tensor = getattr(pool, name, None)
        if tensor is None:
            continue
        if tensor.dim() < 2 or tensor.shape[1] % page_size or not tensor.is_contiguous():
            return None, f"a host KV tensor of shape {tuple(tensor.shape)} is not contiguous pages of {page_size} slots"
        views.extend(tensor.view(tensor.shape[0], tensor.shape[1] // page_size, page_size, *tensor.shape[2:]).unbind(0))
    if not views:
        return None, f"{type(pool).__name__} has no k_buffer/v_buffer/kv_buffer tensors"
    return checkable(views)
