"""The exported review: trial records, cost, the curve report, its plots and HTML."""
