"""The tools a user runs beside training: they use the training core, which never uses them.

plan (with hlo): the memory and collectives of a compiled step; doctor (with findings): a
run's problems and their fixes; bench (with overhead): speed against the PyTorch peers;
convert: text and images to ArrayRecord; export: trained params; launch (with
rank_output): N local processes of one run. cli holds their shared argument parsing. Each
`python -m paisoar_jax.<tool>` is a thin module at the package's top level.
"""
