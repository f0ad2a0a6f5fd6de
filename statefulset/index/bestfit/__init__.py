"""``packing: bestfit``: whole documents packed into samples by best-fit decreasing, in windows."""
