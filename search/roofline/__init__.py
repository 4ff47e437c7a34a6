"""The decode roofline: model and hardware catalogs, step time, the curve, its knee and the
operating point (pure, no torch)."""
