"""The multi-process test harness (``harness.py``, ``worker_harness.py``) and its workers.

``tests/test_*_multihost.py`` start the workers here as real JAX processes on 127.0.0.1.
"""
