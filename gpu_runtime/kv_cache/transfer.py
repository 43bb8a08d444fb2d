"""Page export and import: a sequence's cached pages out of one pool as tensors, and into another pool.

This is the narrow seam the prefill/decode split will use: a prefill worker exports the full pages of a
prompt; a decode worker imports them into its own prefix cache, so the request it then admits finds its
prompt already computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_cache.manager import KVCacheManager, PrefixMatch


@dataclass(frozen=True, slots=True)
class PageExport:
    page_size: int
    page_hashes: list[bytes]  # chained content hashes, one per page, prefix order
    keys: torch.Tensor  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    values: torch.Tensor
    # Which pages of the chain the tensors hold, in order; None: all of them. A decode worker pulls only the
    # pages it lacks, so its export is partial: the rest must be cached here already.
    positions: list[int] | None = None

    @property
    def num_pages(self) -> int:
        return len(self.page_hashes)

    @property
    def num_rows(self) -> int:
        """Pages the tensors hold (all of the chain's, or the positions')."""
        return self.keys.shape[1]


def export_pages(kv: KVCacheManager, pool: KVPool, match: PrefixMatch) -> PageExport:
    """Copies out the cached pages of a prefix (find_cached_prefix's answer) to host memory."""
    pages = torch.tensor(match.page_ids, dtype=torch.long, device=pool.layers[0][0].device)
    keys = torch.stack([k.index_select(0, pages) for k, _ in pool.layers]).cpu()
    values = torch.stack([v.index_select(0, pages) for _, v in pool.layers]).cpu()
    return PageExport(kv.page_size, list(match.hashes), keys, values)


def import_pages(kv: KVCacheManager, pool: KVPool, export: PageExport) -> int:
    """Writes exported pages into this pool's prefix cache; returns how many pages it had to write.

    Pages already cached here are skipped. The chain is imported up to its first page that is neither cached here
    nor in the export (a partial export whose other pages were evicted meanwhile): a page past a gap could never
    be a prefix hit. Imported pages end up free and cached, so they cost nothing until a request uses them and are
    evicted like any other cached page. Raises ValueError if the export does not fit this pool (page size, or not
    enough free pages).
    """
    if kv.num_groups > 1:  # its pages are per group: an export names one block table's (KVCacheManager.lookup)
        return 0
    if export.page_size != kv.page_size:
        raise ValueError(f"page_size: export has {export.page_size}, this pool {kv.page_size}")
    allocator = kv.allocator
    carried = {position: row for row, position in enumerate(export.positions or range(export.num_pages))}
    chain: list[int | None] = []  # this pool's page per chain position; None: to be written from the export
    for position, content_hash in enumerate(export.page_hashes):
        page = allocator.lookup(content_hash)
        if page is None and position not in carried:
            break
        chain.append(page)
    missing = [i for i, page in enumerate(chain) if page is None]
    present = [page for page in chain if page is not None]
    revived = sum(1 for page in present if allocator.is_evictable(page))
    if len(missing) + revived > allocator.num_free_pages:
        raise ValueError(f"pages: {len(missing)} to import, {kv.num_free_pages} free")
    for page in present:  # pinned while allocating, so making room cannot evict the chain's own pages
        allocator.share(page)
    pages = allocator.allocate(len(missing))
    try:
        _copy_rows(pool, export, [carried[i] for i in missing], pages)
    except BaseException:
        allocator.free(present + pages)  # a failure part-way takes nothing: the chain as it was, the new pages empty
        raise
    for page, i in zip(pages, missing, strict=True):
        kv.register_page(page, export.page_hashes[i], parent=export.page_hashes[i - 1] if i else None)
        chain[i] = page
    allocator.free(chain[::-1])  # tail first into the LRU, so the chain's head stays cached longest
    return len(pages)


def _copy_rows(pool: KVPool, export: PageExport, rows: list[int], pages: list[int]) -> None:
    """The export's `rows` into this pool's `pages`, layer by layer."""
    if not pages:
        return
    whole = rows == list(range(export.num_rows))  # every row, in order: no gather needed
    index = torch.tensor(rows, dtype=torch.long)
    target = torch.tensor(pages, dtype=torch.long, device=pool.layers[0][0].device)
    for layer, (k, v) in enumerate(pool.layers):
        keys = export.keys[layer] if whole else export.keys[layer].index_select(0, index)
        values = export.values[layer] if whole else export.values[layer].index_select(0, index)
        k.index_copy_(0, target, keys.to(k.device, k.dtype))
        v.index_copy_(0, target, values.to(v.device, v.dtype))
