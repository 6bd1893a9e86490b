"""S18: prefill/decode disaggregation — prompts and decodes on different engines, the KV cache shipped between.

    router.py          rank 0: an LLMEngine-shaped front for the OpenAI server; routes, streams, fails cleanly
    prefill_worker.py  a prefill instance: prompt + first token, then its KV blocks to the chosen decode instance
    decode_worker.py   a decode instance: answers which blocks its prefix cache holds, adopts the rest block-wise
    instance.py        what both share: an LLMEngine driven by messages, reporting its state to the router
    kv_transfer.py     block messages (CRC + prefix hash checked on receipt), whole blocks of a tensor-parallel
                       instance (KVBlocks), and the transports (MPI, loopback)
    launch.py          `pyengine serve --prefill-instances P --decode-instances D [--tensor-parallel-size T]`:
                       1 + (P + D) x T MPI ranks, each instance's T ranks in their own communicator

The engine side is two small hooks in engine/llm_engine.py: ``prefill_only`` / ``release_prefilled`` (a prefill
engine parks a sequence after its first token) and ``add_prefilled`` / ``commit_prefilled`` (a decode engine adopts
a sequence whose prompt K/V it did not compute). CPython only (MPI); nothing here is imported by ``import pyengine``.
"""
