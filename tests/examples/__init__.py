"""Tests of the deployment examples under deploy/examples."""
