# Distinct tests in cargo test logs: a test is named by its binary (the
# deps file's stem, or `doc:CRATE` for doc-tests) and its name, so a crate
# tested again (the SIMD baseline, other features) counts once; a
# binary without libtest's per-test lines (harness = false) counts the
# numbers of its `test result` line. Prints "passed failed runs".
/^ *Running / {
    bin = $0
    sub(/.*\/deps\//, "", bin); sub(/-[0-9a-f]+\)$/, "", bin)
    listed = 0; next
}
/^ *Doc-tests / { bin = "doc:" $2; listed = 0; next }
/^test .* \.\.\. (ok|FAILED|ignored)/ {
    name = $0; sub(/^test /, "", name)
    status = name; sub(/.* \.\.\. /, "", status); sub(/ .*/, "", status)
    sub(/ \.\.\. [^.]*$/, "", name)
    key = bin "::" name
    listed++
    if (status == "ok") { runs++; ok[key] = 1 }
    else if (status == "FAILED") { runs++; bad[key] = 1 }
    next
}
/^test result: / {
    if (!listed && match($0, /[0-9]+ passed; [0-9]+ failed/)) {
        split(substr($0, RSTART, RLENGTH), f, /[ ;]+/)
        for (i = 1; i <= f[1]; i++) { ok[bin "#" i] = 1; runs++ }
        for (i = 1; i <= f[3]; i++) { bad[bin "#f" i] = 1; runs++ }
    }
    listed = 0
}
END {
    p = 0; n = 0
    for (k in ok) if (!(k in bad)) p++
    for (k in bad) n++
    print p, n, runs + 0
}
