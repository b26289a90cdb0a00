"""The ground floor: what every stage shares (inputs, a step's runtime, allocator records,
random generators, precision, the module tree). Imports nothing above it."""
