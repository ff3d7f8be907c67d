"""Checking layout stores after they are written (``sclayout verify``, ``sclayout inspect``).

:mod:`~sclayout.checks.verify` compares a store with its source value for value,
:mod:`~sclayout.checks.verify_sources` does so for a store built from several sources,
:mod:`~sclayout.checks.verify_store` checks a store from its own bytes, and
:mod:`~sclayout.checks.inspect` reports what a store is made of. They read stores and
sources and never write; the converter (:mod:`sclayout.convert`) does not import them.
"""
