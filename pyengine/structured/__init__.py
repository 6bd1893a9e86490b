"""S15 structured output: JSON Schema, regex, choice and GBNF grammars compiled to token masks.

Pure Python + NumPy, no threads (it runs in Pyodide). Read in this order: `ir.py` (the grammar IR over
bytes), `regex.py`, `json_schema.py`, `gbnf.py` (inputs -> IR), `automaton.py` (IR -> DFA or pushdown
matcher), `vocab.py` (token masks), `matcher.py` (the per-sequence matcher), `processor.py` (the engine's
logits processor).
"""
from .ir import GrammarError
from .matcher import CompiledGrammar, GrammarMatcher, compile_grammar, grammar_rules
from .vocab import TokenVocabulary

__all__ = ["CompiledGrammar", "GrammarError", "GrammarMatcher", "TokenVocabulary", "compile_grammar",
           "grammar_rules"]
