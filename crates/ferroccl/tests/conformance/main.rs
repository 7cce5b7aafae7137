//! The conformance suite: one definition of the point-to-point and collective properties,
//! instantiated per transport, with ranks as threads of this test process (breadth: many
//! shapes, sizes and knobs per second; the multi-process depth lives in the workspace's
//! `tests/mesh.rs`, and over verbs in `tools/softroce/verbs-suite.sh`).
//!
//! Every test of the suite is a function of a [`Suite`] (the transport and the sizes of the
//! work) in `p2p.rs`, `collectives.rs`, `alltoallv.rs`, `nonblocking.rs`, `groups.rs`,
//! `onesided.rs`, `pod.rs`, `weights.rs`, `tp.rs` or `vcoll.rs`; `conformance_suite!` makes one
//! `#[test]` of each in the module of an instantiation, so a test is named
//! `<transport>::<property>`:
//!
//! | module  | transport                                                  | runs          |
//! | ------- | ---------------------------------------------------------- | ------------- |
//! | `shm`   | shm for every peer                                         | everywhere    |
//! | `tcp`   | tcp for every peer                                         | everywhere    |
//! | `tcp_striped` | tcp, writes of 4 KiB and up striped over 3 sockets   | everywhere    |
//! | `tcp_zerocopy` | tcp, writes of 4 KiB and up sent with `MSG_ZEROCOPY` (and from 64 KiB striped over 2 sockets) | everywhere |
//! | `mixed` | `auto` with two host ids: shm inside a host, tcp across    | everywhere    |
//! | `verbs` | RDMA verbs for every peer; fewer ranks, messages and cases | with a device |
//!
//! The verbs tests need the `verbs` feature and a device (`FERROCCL_IB_DEV`,
//! `FERROCCL_IB_GID_INDEX`, as the soft-RoCE VM sets them: `tools/softroce/ci.sh` runs the
//! `verbs::` tests there); without one they skip, unless `FERROCCL_VERBS_REQUIRED=1`, which
//! makes them fail instead. A transport's own tests (the shm ring's knobs, verbs without
//! a device) sit next to its instantiation.

mod alltoallv;
mod collectives;
mod groups;
mod harness;
mod moe;
mod nonblocking;
mod onesided;
mod p2p;
mod pod;
mod tp;
mod vcoll;
mod weights;

use harness::{Suite, Wire};

/// One `#[test]` per property of the suite, each running it over `$suite` (a [`Suite`]
/// expression) where that transport is available.
macro_rules! conformance_suite {
    ($suite:expr) => {
        /// This instantiation's transport and sizes.
        const SUITE: $crate::harness::Suite = $suite;

        conformance_suite!(@tests
            p2p::random_schedules_deliver_exactly,
            p2p::sendrecv_permutations_deliver,
            p2p::split_matches_model_and_subgroups_work,
            p2p::bad_peers_are_invalid_arguments_and_do_not_poison,
            p2p::sendrecv_with_bad_to_leaves_the_recv_stream_intact,
            p2p::sequential_jobs_on_one_store_address_with_different_sizes,
            p2p::mismatch_eager_vs_eager,
            p2p::mismatch_rendezvous_vs_rendezvous,
            p2p::mismatch_eager_send_rendezvous_recv,
            p2p::mismatch_rendezvous_send_eager_recv,
            p2p::dropped_peer_fails_a_blocked_recv_promptly,
            p2p::communicators_on_two_threads_share_the_mesh,
            collectives::collectives_equal_the_reference_exact_values,
            collectives::collectives_equal_the_reference_three_ranks_counts_0_and_1,
            collectives::mesh_and_oneshot_are_bit_equal_to_the_reference_on_random_floats,
            collectives::bruck_and_the_binomial_tree_equal_the_reference,
            collectives::large_allreduce_through_the_pipeline,
            collectives::reductions_on_several_threads_equal_the_reference,
            collectives::bad_arguments_are_errors_not_panics,
            collectives::mismatched_calls_fail_on_every_rank,
            collectives::forced_ll_collectives_equal_the_reference_up_to_and_past_the_slots,
            collectives::forced_ll_is_bit_equal_to_the_reference_on_random_floats,
            collectives::forced_ll_on_split_communicators_next_to_the_world,
            collectives::forced_ll_mismatched_calls_fail_on_every_rank,
            collectives::forced_ll_is_on_in_every_thread_rank_world,
            collectives::forced_ll_runs_ahead_and_stays_correct,
            collectives::forced_ll_two_roots_fail_at_the_next_operation,
            collectives::forced_ll_a_mismatch_deep_in_a_run_ahead_names_its_call,
            collectives::forced_ll_ring_and_sync_calls_mismatch_on_every_rank,
            vcoll::allgatherv_and_reduce_scatterv_equal_the_reference,
            vcoll::bad_operations_fail_on_every_rank,
            vcoll::a_per_call_timeout_overrides_the_communicators,
            alltoallv::alltoallv_equals_the_reference,
            alltoallv::alltoallv_pairwise_equals_the_reference,
            alltoallv::alltoallv_plans_run_many_times,
            alltoallv::alltoallv_bad_arguments_are_errors,
            alltoallv::alltoallv_mismatched_counts_fail_on_every_rank,
            alltoallv::gather_scatter_and_v_forms_equal_the_reference,
            alltoallv::gather_scatter_bad_arguments_and_mismatches_are_errors,
            alltoallv::rooted_plans_run_many_times,
            nonblocking::interleaved_nonblocking_collectives_equal_the_reference,
            nonblocking::plans_run_many_times_with_rewritten_buffers,
            nonblocking::groups_run_as_one_unit,
            nonblocking::requests_are_futures_and_progress_without_a_waiter,
            nonblocking::abort_unblocks_a_rank_waiting_for_a_peer_that_never_comes,
            nonblocking::a_rank_that_only_sends_hears_of_a_peers_abort,
            nonblocking::plans_start_in_scopes_next_to_other_operations,
            nonblocking::eight_ranks_on_two_cores_make_progress_without_waiters,
            nonblocking::forced_ll_interleaved_nonblocking_collectives_equal_the_reference,
            nonblocking::forced_ll_groups_equal_the_reference,
            nonblocking::forced_ll_plans_run_many_times_and_in_scopes,
            nonblocking::abort_unblocks_a_forced_ll_allreduce_whose_peer_never_comes,
            groups::groups_send_and_receive_to_self,
            groups::groups_take_every_scope_call,
            onesided::windows_read_and_write_exactly,
            onesided::concurrent_reads_of_one_window,
            onesided::refused_accesses_touch_nothing,
            onesided::allocated_windows_are_written_by_peers,
            onesided::transfer_plans_run_many_times_with_rewritten_sources,
            onesided::transfer_plans_refuse_bad_entries,
            onesided::put_signal_lands_the_data_before_the_signal,
            onesided::a_refused_plan_entry_fails_the_run_after_the_others_land,
            onesided::strided_blocks_move_column_shards,
            onesided::transfer_plan_signals_follow_their_writes,
            onesided::shared_windows_are_mapped_and_refused_after_drop,
            onesided::signals_need_no_window,
            onesided::reads_of_windows_are_zero_copy_over_verbs,
            onesided::writes_of_windows_are_zero_copy_over_verbs,
            onesided::reads_during_a_drop_are_whole_then_refused,
            weights::weight_sync_moves_random_layouts_exactly,
            weights::weight_sync_never_shows_a_torn_version,
            weights::weight_sync_bad_arguments_are_errors,
            weights::weight_sync_failure_keeps_the_last_version,
            weights::weight_sync_abort_during_a_pull_never_tears,
            weights::weight_sync_moves_random_layouts_exactly_up_to_four_by_four,
            weights::weight_sync_rejects_members_with_other_layouts,
            weights::weight_sync_ignores_the_public_signals,
            weights::weight_sync_typed_views,
            moe::moe_dispatch_combine_equals_the_reference,
            moe::moe_two_micro_batches_interleave,
            moe::moe_bad_input_fails_on_every_rank,
            moe::moe_bad_configs_and_misuse_are_errors,
            moe::moe_low_latency_signals_go_by_words_on_one_host,
            pod::pod_structs_move_exactly,
            pod::pod_zero_sized_types_are_refused,
            pod::pod_count_mismatch_fails_on_both_sides,
            tp::tp_helpers_equal_the_reference,
            tp::tp_bad_shapes_are_errors,
            tp::tp_shapes_that_differ_across_ranks_fail_on_every_rank,
        );
    };
    (@tests $($module:ident :: $name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                if SUITE.here(stringify!($name)) {
                    $crate::$module::$name(&SUITE);
                }
            }
        )*
    };
}

/// The shm, tcp and mixed instantiations. A property test that used to draw its transport
/// at random runs its old case count divided among the transports it drew from (rounded
/// up): 256 / 3 -> 86 random schedules and permutations, 160 / 3 -> 54 splits (shm, tcp,
/// mixed); 24 / 2 -> 12 exact-value collectives and 12 / 2 -> 6 non-blocking sequences
/// (shm, tcp; mixed is new there). Shm runs each persistent plan 1,000 times, the others 200.
const BROAD: Suite = Suite {
    wire: Wire::Shm,
    clocks: true,
    p2p_ranks: 5,
    split_ranks: 6,
    schedule_msgs: 12,
    perm_rounds: 4,
    schedule_cases: 86,
    perm_cases: 86,
    split_cases: 54,
    collective_cases: 12,
    collective_ranks: 5,
    float_ranks: &[2, 3, 5],
    large_count: 1_000_003,
    nonblocking_cases: 6,
    plan_runs: 200,
};

mod shm {
    use crate::harness::{Suite, Wire};

    conformance_suite!(Suite { wire: Wire::Shm, plan_runs: 1000, ..crate::BROAD });

    #[test]
    fn tiny_ring_without_cma_moves_large_messages() {
        crate::p2p::tiny_ring_without_cma_moves_large_messages();
    }
}

mod tcp {
    use crate::harness::{Suite, Wire};

    conformance_suite!(Suite { wire: Wire::Tcp, ..crate::BROAD });
}

/// tcp with its bandwidth paths forced: large writes striped over several sockets
/// (`FERROCCL_TCP_SOCKETS`), and sent zero-copy (`MSG_ZEROCOPY`).
mod tcp_striped {
    use crate::harness::{Suite, Wire};

    conformance_suite!(Suite { wire: Wire::TcpStriped, ..crate::BROAD });
}

mod tcp_zerocopy {
    use crate::harness::{Suite, Wire};

    conformance_suite!(Suite { wire: Wire::TcpZeroCopy, ..crate::BROAD });
}

mod mixed {
    use crate::harness::{Suite, Wire};

    conformance_suite!(Suite { wire: Wire::Mixed, ..crate::BROAD });
}

/// The VM is emulated and slow: fewer ranks, messages and cases, and no wall-clock
/// promptness checks (the errors must still be the right ones, not the deadline).
mod verbs {
    use crate::harness::{Suite, Wire};

    conformance_suite!(Suite {
        wire: Wire::Verbs,
        clocks: false,
        p2p_ranks: 4,
        split_ranks: 4,
        schedule_msgs: 10,
        perm_rounds: 3,
        schedule_cases: 16,
        perm_cases: 16,
        split_cases: 8,
        collective_cases: 4,
        collective_ranks: 4,
        float_ranks: &[2, 3],
        large_count: 1_000_003,
        nonblocking_cases: 6,
        plan_runs: 200,
    });

    /// Runs everywhere: without a device (or the feature) it checks the error.
    #[test]
    fn without_a_device_is_a_clear_error() {
        crate::p2p::verbs_without_a_device_is_a_clear_error(&SUITE);
    }
}

/// Not a property of a transport: once.
#[test]
fn handles_are_send_and_sync() {
    nonblocking::handles_are_send_and_sync();
}
