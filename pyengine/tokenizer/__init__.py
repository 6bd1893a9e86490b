"""S02: tokenizers read from GGUF metadata -- byte-level BPE and SentencePiece-style BPE -- plus
streaming detokenization and chat templates. See tokenizer.py for the pipeline."""
from .detokenize import IncrementalDetokenizer
from .tokenizer import Tokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer"]
