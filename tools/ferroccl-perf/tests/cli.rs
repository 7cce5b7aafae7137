//! The binary end to end: real ranks (started by `--ranks`, through ferroccl-run's library),
//! the table, the check, JSON and SVG output, and command-line errors.

use std::path::PathBuf;
use std::process::{Command, Output};

fn perf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferroccl-perf"))
        .args(args)
        .env_remove("FERROCCL_RANK")
        .env_remove("RANK")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("SLURM_PROCID")
        .env("FERROCCL_TIMEOUT", "30")
        .output()
        .expect("run ferroccl-perf")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The table's rows: whitespace-separated fields of the lines that are not comments.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferroccl-perf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn a_corrupted_result_shows_wrong_elements_and_fails() {
    let o = perf(&["allreduce", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "-c", "1", "--ranks", "2", "--corrupt-rank", "1"]);
    let (out, err) = text(&o);
    let rows = rows(&out);
    assert_eq!(rows.len(), 1, "{out}\n{err}");
    let r = &rows[0];
    assert_eq!(&r[..5], ["1024", "256", "f32", "sum", "-1"], "{out}");
    let (oop, ip): (u64, u64) = (r[8].parse().unwrap(), r[12].parse().unwrap());
    assert!(oop > 0 && ip > 0, "#wrong must be > 0 in both variants:\n{out}");
    assert!(out.contains("FAILED"), "{out}");
    assert!(!o.status.success(), "a run with wrong elements must fail: {:?}\n{err}", o.status);
    assert!(err.contains("wrong elements"), "{err}");
}

#[test]
fn a_clean_run_shows_no_wrong_elements() {
    let json = tmp("clean.json");
    let svg = tmp("clean.svg");
    let o = perf(&[
        "all",
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "2",
        "-w",
        "1",
        "-d",
        "bf16",
        "--ranks",
        "3",
        "--root",
        "2",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{:?}\n{out}\n{err}", o.status);
    let rows = rows(&out);
    // 10 collectives x sizes 8, 64, 512, 4096.
    assert_eq!(rows.len(), 10 * 4, "{out}");
    for r in &rows {
        assert_eq!(r.len(), 14, "{r:?}");
        for w in [&r[8], &r[12]] {
            assert!(w == "0" || w == "N/A", "{r:?}");
        }
        assert!(r[8] == "0" || r[12] == "0", "every row checks at least one variant: {r:?}");
    }
    assert_eq!(out.matches("wrong elements: 0 OK").count(), 10, "{out}");
    assert!(out.contains("Avg bus bandwidth"), "{out}");
    assert!(out.contains("ranks 3") && out.contains("transport:") && out.contains("init:"), "{out}");
    assert!(err.contains("(4/4)"), "progress on stderr: {err}");

    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["ranks"], 3);
    assert_eq!(v["dtype"], "bf16");
    assert!(v["machine"]["nproc"].as_u64().unwrap() >= 1);
    assert_eq!(v["runs"].as_array().unwrap().len(), 10);
    assert_eq!(v["runs"][3]["collective"], "broadcast");
    assert!(v["runs"][3]["rows"][0]["out_of_place"].is_null());
    assert_eq!(v["runs"][3]["rows"][0]["root"], 2);
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.contains("<polyline"), "{svg_text}");

    // The JSON overlays as a baseline.
    let svg2 = tmp("overlay.svg");
    let o = perf(&[
        "allreduce",
        "-b",
        "8",
        "-e",
        "64",
        "-f",
        "8",
        "-n",
        "1",
        "-w",
        "0",
        "--ranks",
        "2",
        "--plot",
        svg2.to_str().unwrap(),
        "--baseline",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let overlay = std::fs::read_to_string(&svg2).unwrap();
    assert!(overlay.contains("stroke-dasharray") && overlay.contains("FerroCCL allreduce bf16"), "{overlay}");

    // `plot` draws results files without running anything.
    let svg3 = tmp("files.svg");
    let o = perf(&["plot", svg3.to_str().unwrap(), json.to_str().unwrap()]);
    assert!(o.status.success(), "{:?}", text(&o));
    let drawn = std::fs::read_to_string(&svg3).unwrap();
    // 10 collectives: 4 with both variants, alltoall, alltoallv, sendrecv, allgatherv and
    // reduce_scatterv out of place only, broadcast in place only: 2 + 2 + 2 + 1 + 2 + 1 + 1
    // + 1 + 1 + 1 = 14 series, each a line in both panels.
    assert_eq!(drawn.matches("<polyline").count(), 28, "{drawn}");
    let o = perf(&["plot", svg3.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
}

#[test]
fn plans_run_checked_and_a_corrupted_plan_result_fails() {
    let json = tmp("plan.json");
    let o = perf(&[
        "all",
        "--plan",
        "-b",
        "8",
        "-e",
        "64K",
        "-f",
        "64",
        "-n",
        "3",
        "-w",
        "1",
        "--ranks",
        "3",
        "--root",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{:?}\n{out}\n{err}", o.status);
    assert!(out.contains("persistent plans"), "{out}");
    let rows = rows(&out);
    // allreduce, allgather, reduce_scatter, broadcast x sizes 8, 512, 32K, 64K.
    assert_eq!(rows.len(), 4 * 4, "{out}");
    for (k, r) in rows.iter().enumerate() {
        // allreduce and broadcast: in place only; allgather and reduce_scatter: out of place only.
        let (oop, ip) = if (4..12).contains(&k) { ("0", "N/A") } else { ("N/A", "0") };
        assert_eq!((r[8].as_str(), r[12].as_str()), (oop, ip), "{r:?}\n{out}");
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((v["plan"].as_bool(), v["label"].as_str()), (Some(true), Some("FerroCCL plan")));

    for coll in ["allreduce", "reduce_scatter"] {
        let o = perf(&[coll, "--plan", "-b", "4K", "-e", "4K", "-n", "2", "-w", "1", "--ranks", "2", "--corrupt-rank", "1"]);
        let (out, err) = text(&o);
        assert!(!o.status.success(), "{coll}: a run with wrong elements must fail\n{out}\n{err}");
        assert!(out.contains("FAILED") && err.contains("wrong elements"), "{coll}\n{out}\n{err}");
    }
}

#[test]
fn bad_arguments_are_named_and_exit_2() {
    for (args, want) in [
        (&["allreduce", "-d", "f7", "--ranks", "2"][..], "-d \"f7\""),
        (&["allreduce", "-b", "lots"][..], "-b \"lots\""),
        (&["reduce", "--plan"][..], "--plan: reduce has no persistent plan"),
        (&["shuffle"][..], "unknown collective \"shuffle\""),
        (&[][..], "missing the collective"),
        (&["allreduce", "--ranks", "2", "--plot", "/tmp/x.svg", "--baseline", "/nonexistent/b.json"][..], "--baseline /nonexistent/b.json"),
    ] {
        let o = perf(args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // Not under a launcher and no --ranks: says how to start it.
    let o = perf(&["allreduce"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--ranks N"), "{err}");
}

#[test]
fn the_measurement_subcommands_run_and_check() {
    let o = perf(&["latency", "--sizes", "8,4K", "-n", "5", "-w", "2", "--batches", "2", "--raw", "--ranks", "2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{:?}\n{out}\n{err}", o.status);
    let lat = rows(&out);
    assert_eq!(lat.len(), 4, "{out}");
    assert_eq!((lat[0][1].as_str(), lat[1][1].as_str()), ("blocking", "plan"), "{out}");
    assert_eq!(out.matches("#batch ").count(), 2 * 2 * 2, "--raw prints every batch: {out}");
    assert!(out.contains("plan / blocking") && out.contains("wrong elements: 0 OK"), "{out}");
    for coll in ["allgather", "broadcast", "reduce_scatter"] {
        let o =
            perf(&["latency", "--sizes", "8", "--dtype", "bf16", "--coll", coll, "-n", "3", "-w", "1", "--batches", "1", "--ranks", "3"]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{coll}: {:?}\n{out}\n{err}", o.status);
        assert!(out.contains(&format!("latency: {coll} bf16")) && out.contains("wrong elements: 0 OK"), "{out}");
    }

    let o = perf(&["idle", "--seconds", "0.2", "--ranks", "2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{:?}\n{out}\n{err}", o.status);
    assert_eq!(rows(&out).len(), 2, "one row per rank: {out}");
    assert!(out.contains("allreduce OK"), "{out}");
    assert!(err.contains("ferroccl-progre"), "the progress thread was started and is listed: {err}");

    let o = perf(&["overlap", "--size", "64K", "--compute-ms", "0.05", "-n", "2", "--batches", "2", "--ranks", "2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{:?}\n{out}\n{err}", o.status);
    let forms: Vec<String> = rows(&out).iter().map(|r| r[..r.len() - 4].join(" ")).collect();
    assert_eq!(forms, ["sequential", "overlapped", "compute only", "allreduce only"], "{out}");
    assert!(out.contains("overlapped / sequential") && out.contains("checked iterations: OK"), "{out}");

    for (args, want) in [
        (&["latency", "--sizes", "8,x"][..], "--sizes \"8,x\""),
        (&["idle", "--seconds", "0"][..], "--seconds \"0\""),
        (&["overlap", "--frobnicate"][..], "--frobnicate"),
    ] {
        let o = perf(args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && err.contains("usage: ferroccl-perf"), "{args:?}: {err}");
    }
    let o = perf(&["latency", "--help"]);
    assert!(o.status.success() && text(&o).0.contains("comm.plan(op::allreduce"), "{:?}", text(&o));
}

#[test]
fn the_weights_subcommand_runs_and_checks() {
    for sources in ["1", "2"] {
        let o = perf(&[
            "weights",
            "--model-bytes",
            "256K",
            "--tensors",
            "9",
            "--sources",
            sources,
            "--rounds",
            "2",
            "--iters",
            "2",
            "--ranks",
            "3",
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "--sources {sources}: {:?}\n{out}\n{err}", o.status);
        assert!(out.contains(&format!("{sources} source(s) -> {} destination(s)", 3 - sources.parse::<usize>().unwrap())), "{out}");
        // Two rounds, then round 1 and rounds 2..2 again in the summary.
        let rows = rows(&out);
        assert_eq!(rows.iter().map(|r| r[0].as_str()).collect::<Vec<_>>(), ["1", "2", "1", "2..2"], "{out}");
        assert!(rows.iter().all(|r| r.len() == 9), "{out}");
    }
    for (args, code, want) in [
        (&["weights", "--model-bytes", "1"][..], 2, "--model-bytes \"1\""),
        (&["weights", "--tensors", "0"][..], 2, "--tensors \"0\""),
        (&["weights", "--sources", "2", "--ranks", "2", "--model-bytes", "64K"][..], 1, "--sources 2 needs 1 to 1 sources"),
    ] {
        let o = perf(args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let o = perf(&["weights", "--help"]);
    assert!(o.status.success() && text(&o).0.contains("memcpy bound"), "{:?}", text(&o));
}

#[test]
fn ranks_started_by_ranks_are_pinned_unless_no_bind() {
    // One rank: there is always a CPU for it, so auto binding pins it (as ferroccl-run does).
    let base = ["allreduce", "-b", "8", "-e", "8", "-n", "1", "-w", "0", "--ranks", "1"];
    let json = tmp("pinned.json");
    let mut args = base.to_vec();
    args.extend(["--json", json.to_str().unwrap()]);
    let o = Command::new(env!("CARGO_BIN_EXE_ferroccl-perf"))
        .args(&args)
        .env_remove("FERROCCL_RANK")
        .env_remove("FERROCCL_BIND")
        .env("FERROCCL_TIMEOUT", "30")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("#  pinned: CPUs "), "{out}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v["pinned_cpus"][0].is_u64(), "{v}");

    let mut args = base.to_vec();
    args.push("--no-bind");
    let o = perf(&args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("#  pinned: no"), "{out}");

    // The shared options are the subcommands' too, in any place after the subcommand.
    let o = perf(&["idle", "--no-bind", "--seconds", "0.1", "--ranks", "1"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = perf(&["plot", "--ranks", "2"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
}
