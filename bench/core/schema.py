"""The results row, stated once: its columns (each with what it holds), its key, the certificate
kinds a row may carry, its roles and its version. The store (bench/core/store.py) checks a table
against it, bench/sweep/rows.py writes rows of it, and the gate, ``compare`` and the report read
their names from here."""

from __future__ import annotations

from bounds.certificates import KINDS as CERTIFICATE_KINDS

# 2: rows carry ``role`` (bound, pgd, timing, block), ``certificate`` (how a value is known) and
# ``finding`` (a published statement found unsound), and ``schema_version``; solver names say
# Lanczos; run.json lists every cell; roles certify and accuracy, whose rows (and pgd_margin's) carry
# the optional columns below (not yet released: extended without a bump); a plugin bound's rows carry
# ``plugin_sha256`` (PLUGIN_COLUMNS below), absent from every other row, so that a table
# without plugins reads as before
SCHEMA_VERSION = 2
KEY = ["sweep", "cell_id", "role", "bound", "sample", "head", "block"]
NUMERIC = ["value", "pgd", "ratio", "seconds", "sample", "head", "block", "certificate_p"]
BOOLEAN = ["certified", "finding", "sound", "violation"]
REQUIRED = [*KEY, "schema_version", "certificate", *BOOLEAN, *NUMERIC]
# the network rows' columns (CERTIFY_COLUMNS below) and the pretrained study's
# (PRETRAINED_COLUMNS; model_version is text), checked where a table has them; other
# rows leave them empty, so their booleans are nullable
OPTIONAL_NUMERIC = ["label", "margin", "pgd_margin", "attack_steps", "tokens", "radius", "peak_mib",
                    "vit_depth", "vit_heads", "vit_d", "vit_c", "vit_qk", "vit_margin_eps",
                    "vit_test_accuracy", "tn_first_order", "tn_kinks", "tn_attention", "tn_project",
                    "tn_unstable", "tn_straddling", "input_mean", "input_std", "max_rel_err"]
OPTIONAL_BOOLEAN = ["correct", "certified_prop1", "certified_pairwise", "pgd_broken", "sent_to_crown",
                    "tn_backward"]
# what a row is: a bound's value, a PGD value, a timing, a block of a stack, a network's verdict per
# image, an accuracy
ROLES = ("bound", "pgd", "timing", "block", "certify", "accuracy")
NAMED = ("bound", "certify")  # the roles whose ``bound`` is a name of bounds/registry.py
# bounds.certificates' kinds, strongest first (relaxation: CROWN and α-CROWN), and ``attained`` for a
# PGD row (a value from below)
KINDS = (*CERTIFICATE_KINDS, "attained")

# the columns every row of bench/sweep/rows.py carries
COLUMNS = ["role", "bound", "sample", "head", "block", "certified", "certificate", "certificate_p",
           "certificate_seeds", "finding", "objective", "value", "pgd", "ratio", "sound", "violation",
           "seconds", "pgd_seconds"]
# taylor_net's diagnostics on its certify rows (docs/bounds.md §5.1), summed over the blocks; the
# per-block split is in ``bench certify --json``
DIAGNOSTICS = {"tn_first_order": "first-order loss ε‖Gᵀc‖ at the class closest to failing",
               "tn_kinks": "loss to the relaxed kinks (ReLU neurons, straddling tokens) there",
               "tn_attention": "attention's Taylor remainders there, every block",
               "tn_project": "LayerProject's second-order remainders there, every block",
               "tn_unstable": "ReLU neurons whose range contains 0, every block",
               "tn_straddling": "tokens whose ball straddles LayerProject's sphere, every block",
               "tn_backward": "the backward pass's bound was the better one at that class (the split "
                              "above is then the backward pass's, else the forward set's)"}

# the extra columns of network rows (certify, pgd_margin, accuracy); absent from other rows
CERTIFY_COLUMNS = {"label": "the image's class", "correct": "classified correctly",
                   "margin": "F_y − max_{j≠y} F_j at the clean image",
                   "certified_prop1": "certified by LoFAST Proposition 1",
                   "certified_pairwise": "certified by the pairwise-head test (ours)",
                   "pgd_margin": "the smallest margin PGD found in the ball",
                   "pgd_broken": "PGD found a point of the ball not classified as the label",
                   "sent_to_crown": "a cascade row's image went on to CROWN (the first bound left it)",
                   "attack_steps": "PGD steps of an accuracy row",
                   "peak_mib": "peak memory of a timed computation of the cost task, MiB above its start"
                   } | DIAGNOSTICS
# the extra columns of the pretrained study's rows (docs/bounds.md §1.6); absent from other rows
PRETRAINED_COLUMNS = {"model_version": "version of the model package (models/pretrained.py)",
                      "tokens": "n, the sentence's tokens with [CLS] and [SEP]",
                      "radius": "the absolute ε: the cell's relative eps × the median token norm"}
# the extra columns of the imported layers' rows (task ``imported``, bench/sweep/tasks.py)
IMPORTED_COLUMNS = {"radius": PRETRAINED_COLUMNS["radius"],
                    "imported_node": "the attention's node in the imported graph (its manifest's 'node')"}
# the tasks of a network read from a user's file (bench/sweep/network_files.py): the suite's network
# bounds, and the same with CROWN beside them; the report gives them a table of their own
FILE_TASKS = ("certify_file", "certify_file_crown")
# the extra columns of a network file's rows (tasks certify_file, certify_file_crown: bench/sweep/
# network_files.py); its file and data file are in ``model`` and ``dataset``
FILE_COLUMNS = {"network_sha256": "the network file's sha256, first 16 hex digits",
                "data_sha256": "the data file's sha256, first 16 hex digits",
                "input_mean": "the model's input normalization (x − mean)/std, folded into its embedding",
                "input_std": "the same std",
                "max_rel_err": "largest relative error of the recovered network's logits to the runtime's"}
# a plugin bound's rows (bound and certify): the sha256 of the plugin file that computed them
# (docs/guide/plugins.md), so that compare never joins rows of a changed file with the old ones;
# absent from every other row (a built-in bound's rows read as the committed baseline's)
PLUGIN = "plugin_sha256"
PLUGIN_COLUMNS = {PLUGIN: "sha256 of the plugin file that defined the bound"}
EXTRA_COLUMNS = CERTIFY_COLUMNS | PRETRAINED_COLUMNS | IMPORTED_COLUMNS | FILE_COLUMNS | PLUGIN_COLUMNS


# the trained network a model task ran on, from its card: the report's grid axes come from here
MODEL_COLUMNS = {"vit_depth": "blocks", "vit_heads": "heads per block", "vit_d": "token width",
                 "vit_c": "cap on per-head ‖W^V‖, ‖W^O‖ (NaN: none)",
                 "vit_qk": "cap on per-head ‖W^Q‖, ‖W^K‖ (NaN: none)",
                 "vit_margin_eps": "Lipschitz-margin training radius (0: cross-entropy)",
                 "vit_test_accuracy": "clean accuracy over the whole test set (the card's)"}


