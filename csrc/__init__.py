"""C++/CUDA sources of pdkv.native, installed as package data (``pdkv.csrc``).

Nothing here is imported for its code: pdkv.native finds this directory,
hashes the sources and compiles them on first use (see its docstring).
"""
