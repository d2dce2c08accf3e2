"""Attention masks for packed windows, where one window holds several documents: a query
attends to earlier positions of its own document only. Built from where the documents
start (a bool (B, T) tensor: the BOS positions of pre-training text, the first token of
each conversation in supervised fine-tuning, whose every turn begins with BOS), in
the form the model runs fastest: a dense (B, 1, T, T) mask for SDPA, or a FlexAttention
BlockMask that lets the kernel skip the 128 x 128 blocks that cross documents."""
import torch
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128  # FlexAttention's default block size


def document_ids(starts):
    """(B, T) index of the document each position belongs to, non-decreasing along T. A document
    begins at each True of `starts`; tokens before the window's first (the tail of a document that
    began in an earlier window) form a document of their own."""
    return torch.cumsum(starts.to(torch.int32), dim=1)


# GPUs whose shared memory per block (163 KiB and more) holds FlexAttention's default Triton kernels,
# backward included: A100 (8.0), H100/H200 (9.0), B200 (10.0). The consumer parts' 99 KiB (8.6, 8.9,
# 12.x) and sm 7.5's 64 KiB fail to compile some of them ("out of resource: shared memory").
FLEX_CAPABILITIES = ((8, 0), (9, 0), (10, 0))


def flex_fits(device: torch.device) -> bool:
    """Whether FlexAttention's compiled kernels run on `device`: a GPU of FLEX_CAPABILITIES."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in FLEX_CAPABILITIES


def document_causal_mask(starts, flex=None):
    """The mask for the model's attention: a BlockMask where FlexAttention fits the GPU (flex=None),
    the dense mask elsewhere: on CPU FlexAttention has no backward (scripts/bench/bench_ops.py
    attention), and on other GPUs SDPA takes the dense mask in its memory-efficient kernel."""
    if flex is None:
        flex = flex_fits(starts.device)
    return document_block_mask(starts) if flex else dense_document_mask(starts)


def dense_document_mask(starts):
    """(B, 1, T, T) bool, True = may attend. The diagonal is always True, so no row is fully
    masked (which would give NaN in SDPA)."""
    doc_ids = document_ids(starts)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    T = starts.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=starts.device).tril()
    return (same_doc & causal).unsqueeze(1)


def document_block_mask(starts) -> BlockMask:
    """The dense mask as a FlexAttention BlockMask, read off the document boundaries per block.

    Document ids never decrease along a window, so a block's documents run from the id at its
    first position to the id at its last. For a key block j before a query block i:
      * some entry is allowed iff the key block's last document is the query block's first;
      * every entry is allowed ("full": no mask_mod needed) iff the key block's first document
        is the query block's last, i.e. both blocks lie in one document.
    The diagonal block is always partial (causal inside). A few small tensor ops per batch, on
    the device, with no host read, where create_block_mask would evaluate the mask at every
    one of the T x T positions.
    """
    doc_ids = document_ids(starts)
    B, T = doc_ids.shape
    blocks = -(-T // BLOCK)
    starts = torch.arange(blocks, device=doc_ids.device) * BLOCK
    first = doc_ids[:, starts]  # (B, blocks): the lowest document id in each block
    last = doc_ids[:, (starts + BLOCK - 1).clamp(max=T - 1)]  # the highest
    before = torch.ones(blocks, blocks, dtype=torch.bool, device=doc_ids.device).tril(-1)  # [query, key]
    diagonal = torch.eye(blocks, dtype=torch.bool, device=doc_ids.device)
    touches = (before & (last[:, None, :] == first[:, :, None])) | diagonal
    # A short last block (T not a multiple of 128) stays partial, as create_block_mask has it.
    whole = (starts + BLOCK <= T)[:, None]
    full = before & whole & (first[:, None, :] == last[:, :, None])

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return BlockMask.from_kv_blocks(*_listed(touches & ~full), *_listed(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=causal_same_document, seq_lengths=(T, T))


def _listed(chosen):
    """(B, Q, K) bool blocks -> BlockMask's (B, 1, Q) counts and (B, 1, Q, K) key block indices, chosen ones first."""
    counts = chosen.sum(-1, dtype=torch.int32)
    indices = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]
