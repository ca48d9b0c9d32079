"""Fails when a ctest test has no label.

The default suite leaves labels out (scripts/test: chaos, long, bench), and
a doctest case's label is its TEST_SUITE, found at build time by asking the
test binary with the case's name as a filter: a comma in the name splits
that filter, the lookup finds nothing and the case silently loses its
label, running where it was meant not to. So every test must carry one.
Usage: check_labels.py CTEST BUILD_DIR
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

# ctest lists the tests from a copy of the build tree's CTestTestfile.cmake
# files: run in the build tree itself, it would replace the LastTest.log of
# the ctest run this test is part of (scripts/test reads the skip reasons
# there).
with tempfile.TemporaryDirectory() as tree:
    for folder, _, files in os.walk(sys.argv[2]):
        if "CTestTestfile.cmake" in files:
            into = os.path.join(tree, os.path.relpath(folder, sys.argv[2]))
            os.makedirs(into, exist_ok=True)
            shutil.copy(os.path.join(folder, "CTestTestfile.cmake"), into)
    listing = subprocess.run([sys.argv[1], "--test-dir", tree, "-N", "--show-only=json-v1"],
                             check=True, capture_output=True, text=True).stdout
unlabelled = []
for test in json.loads(listing)["tests"]:
    labels = [p["value"] for p in test.get("properties", []) if p["name"] == "LABELS"]
    if not any(labels):
        unlabelled.append(test["name"])
for name in unlabelled:
    print(f"no label (a comma in a doctest name drops it): {name}")
print(f"{len(unlabelled)} of {len(json.loads(listing)['tests'])} tests have no label")
sys.exit(1 if unlabelled else 0)
