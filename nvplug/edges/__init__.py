"""The two protocols that every source and every sink follows."""
