"""The data pipeline: token stream, packing, masking, sample order, sources, mixtures, loaders."""
