"""The Python clients' checks (python_checks.py runs them): one module per client, each with `version()`
and `CHECKS`, a dict of name -> check(Setup) returning a one-line detail or raising."""
