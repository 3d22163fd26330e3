"""Where admission meets the prompt cache: restore a job's cached prefix, keep its prompt after.

A lookup borrows the entry it found until the restore has reported, so no keep can evict it
meanwhile; a failed restore makes lookups miss the entry (it is freed once unborrowed) and the job
prefills in full. Only BackendBroken goes further: any other failure costs the cache, not the job.
"""

from __future__ import annotations

import logging

from tpserve.server.backend import Backend, attempt
from tpserve.server.lane_job import Job
from tpserve.server.prompt_cache import PromptCache

log = logging.getLogger(__name__)


def restore_prefix(cache: PromptCache | None, backend: Backend, job: Job, max_tokens: int) -> int:
    """Restore the longest cached prefix of the job's prompt into its lane, at most `max_tokens`
    (what its blocks hold); the tokens restored."""
    if cache is None or max_tokens <= 0:
        return 0
    borrow = cache.lookup(job.cache_ids)
    if borrow is None:
        return 0
    num_tokens = min(borrow.num_tokens, max_tokens)
    restored, error = attempt(backend.restore, job.lane, borrow.entry_id, num_tokens)
    if error is not None:
        log.warning("restoring cache entry %d failed (%r); prefilling in full", borrow.entry_id, error)
    if not restored:
        cache.restore_failed(borrow)  # lookups miss it now; freed once unborrowed
        return 0
    cache.release(borrow)
    return num_tokens


def keep_prompt(cache: PromptCache | None, backend: Backend, job: Job) -> None:
    """Keep the job's prefilled prompt (one point, the best keep_points offers) for later prompts
    that start the same way."""
    if cache is None:
        return
    for num_tokens in cache.keep_points(job.cache_ids, job.request.keep_boundaries):
        entry_id = cache.reserve(num_tokens)  # evicts (EVICT on the wire) to make room
        if entry_id is None:
            continue
        kept, error = attempt(backend.keep, job.lane, num_tokens, entry_id)
        if error is not None:
            log.warning("keeping %d prompt tokens failed (%r)", num_tokens, error)
        if kept:
            cache.commit(entry_id, job.cache_ids[:num_tokens])
        else:
            cache.abort(entry_id)
        return
