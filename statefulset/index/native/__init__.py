"""``packing: native``'s index maths: keys, the keyed permutation, windows and the blend tree, all O(1)."""
