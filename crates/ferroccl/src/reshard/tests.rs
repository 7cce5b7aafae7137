//! Routing tables: hand-made cases, errors, random models (proptest), a large model.

use ferroccl_kernels::DType;
use proptest::prelude::*;

use super::verify::coverage_counts;
use super::*;

fn model(ranks: usize, tensors: Vec<TensorLayout>) -> ModelLayout {
    ModelLayout::new(ranks, tensors).expect("a valid layout")
}

fn one(ranks: usize, dtype: DType, shape: [usize; 2], p: Placement) -> ModelLayout {
    model(ranks, vec![TensorLayout::new("w", dtype, shape, p)])
}

/// Computes, verifies and checks determinism.
fn route(src: &ModelLayout, dst: &ModelLayout) -> RoutingTable {
    let t = RoutingTable::compute(src, dst).expect("a routing table");
    if let Err(e) = t.verify(src, dst) {
        panic!("verify: {e}\n{}", t.explain(src, dst));
    }
    assert_eq!(t, RoutingTable::compute(src, dst).unwrap(), "deterministic");
    t
}

#[test]
fn replicated_to_row_shards_is_one_contiguous_piece_per_destination_from_distinct_senders() {
    let src = one(4, DType::F32, [8, 4], Placement::replicated(4));
    let dst = one(4, DType::F32, [8, 4], Placement::rows(&[2, 2, 2, 2]));
    let t = route(&src, &dst);
    let mut senders = Vec::new();
    for d in 0..4 {
        let p = t.pieces_to(d);
        assert_eq!(p.len(), 1, "{}", t.explain(&src, &dst));
        assert!(p[0].is_contiguous());
        assert_eq!((p[0].row_bytes, p[0].dst_offset, p[0].region), (32, 0, Block::new(2 * d, 2, 0, 4)));
        assert_eq!(p[0].src_offset, 2 * d * 16);
        senders.push(p[0].src_rank);
    }
    senders.sort_unstable();
    assert_eq!(senders, [0, 1, 2, 3]);
    assert!((0..4).all(|s| t.bytes_from(s) == 32));
}

#[test]
fn row_to_column_shards_are_one_strided_piece_per_pair() {
    let src = one(2, DType::Bf16, [8, 6], Placement::rows(&[4, 4]));
    let dst = one(3, DType::Bf16, [8, 6], Placement::cols(&[2, 2, 2]));
    let t = route(&src, &dst);
    assert_eq!(t.pieces().len(), 6);
    for p in t.pieces() {
        assert_eq!((p.rows, p.row_bytes, p.src_stride, p.dst_stride), (4, 4, 12, 4), "{p:?}");
        assert_eq!(p.src_offset, p.dst_rank * 4);
        assert_eq!(p.dst_offset, p.src_rank * 16);
    }
    assert_eq!(t.pieces_from(0).count(), 3);
    assert_eq!(t.bytes_from(1), 48);
    assert_eq!(t.bytes_to(2), 32);
}

#[test]
fn column_to_row_shards_and_back() {
    let cols = one(3, DType::F32, [6, 9], Placement::cols(&[4, 0, 5]));
    let rows = one(2, DType::F32, [6, 9], Placement::rows(&[1, 5]));
    let t = route(&cols, &rows);
    // Sender 1 holds nothing: 2 senders x 2 receivers, each a strided piece except the
    // one-row destination (contiguous).
    assert_eq!(t.pieces().len(), 4);
    assert_eq!(t.bytes_from(1), 0);
    assert!(t.pieces_to(0).iter().all(Piece::is_contiguous));
    assert!(t.pieces_to(1).iter().all(|p| p.rows == 5));
    route(&rows, &cols);
}

#[test]
fn uneven_shards_and_every_m_n_up_to_four() {
    let shape = [13, 7];
    for m in 1..=4 {
        for n in 1..=4 {
            let uneven = |k: usize| -> Vec<usize> {
                let mut s: Vec<usize> = (0..k).map(|i| (i * 5 + 3) % 7).collect();
                let sum: usize = s.iter().sum();
                if sum > 13 {
                    s = vec![0; k];
                    s[k - 1] = 13;
                } else {
                    s[0] += 13 - sum;
                }
                s
            };
            let placements = |k: usize| {
                vec![
                    Placement::replicated(k),
                    Placement::rows(&uneven(k)),
                    Placement::cols(&{
                        let mut c = vec![7 / k; k];
                        c[0] += 7 % k;
                        c
                    }),
                    Placement::rows_replicated(&[13], k),
                ]
            };
            for ps in placements(m) {
                for pd in placements(n) {
                    for dtype in [DType::F32, DType::Bf16, DType::U8, DType::F64] {
                        let src = one(m, dtype, shape, ps.clone());
                        let dst = one(n, dtype, shape, pd.clone());
                        let t = route(&src, &dst);
                        let want: usize = (0..n).map(|d| dst.block(d, 0).unwrap().elems() * dtype.size()).sum();
                        assert_eq!((0..n).map(|d| t.bytes_to(d)).sum::<usize>(), want);
                        assert_eq!((0..m).map(|s| t.bytes_from(s)).sum::<usize>(), want);
                    }
                }
            }
        }
    }
}

#[test]
fn ranks_holding_nothing_send_and_receive_nothing() {
    let src = one(3, DType::F32, [4, 4], Placement::blocks(vec![Block::EMPTY, Block::new(0, 4, 0, 4), Block::new(7, 0, 9, 9)]));
    let dst = one(2, DType::F32, [4, 4], Placement::blocks(vec![Block::new(1, 2, 1, 2), Block::EMPTY]));
    let t = route(&src, &dst);
    assert_eq!((t.bytes_from(0), t.bytes_from(1), t.bytes_from(2)), (0, 16, 0));
    assert_eq!((t.bytes_to(0), t.bytes_to(1), t.pieces_to(1).len(), t.pieces_to(7).len()), (16, 0, 0, 0));
    assert_eq!(dst.buffer_len(1), Some(0));
}

#[test]
fn one_d_tensors_are_columns_and_move_as_runs() {
    let v = |p| TensorLayout::vector("bias", DType::Bf16, 10, p);
    let src = model(2, vec![v(Placement::rows(&[3, 7]))]);
    let dst = model(3, vec![v(Placement::rows(&[4, 4, 2]))]);
    assert_eq!(src.tensors()[0].shape(), [10, 1]);
    let t = route(&src, &dst);
    assert!(t.pieces().iter().all(Piece::is_contiguous));
    assert_eq!(t.pieces().len(), 4);
    // The row form [1, n] sharded by columns is contiguous too.
    let r = |p| TensorLayout::new("bias", DType::Bf16, [1, 10], p);
    let t = route(&model(2, vec![r(Placement::cols(&[3, 7]))]), &model(3, vec![r(Placement::cols(&[4, 4, 2]))]));
    assert!(t.pieces().iter().all(Piece::is_contiguous));
}

#[test]
fn element_sizes_follow_the_dtype() {
    for (dtype, size) in [(DType::F32, 4), (DType::Bf16, 2), (DType::U8, 1), (DType::F64, 8)] {
        let src = one(1, dtype, [3, 5], Placement::replicated(1));
        let dst = one(2, dtype, [3, 5], Placement::cols(&[2, 3]));
        let t = route(&src, &dst);
        assert_eq!(t.bytes_to(1), 9 * size);
        assert_eq!(t.pieces_to(1)[0].row_bytes, 3 * size);
        assert_eq!(t.pieces_to(1)[0].src_stride, 5 * size);
    }
}

#[test]
fn buffers_place_tensors_in_list_order_aligned() {
    let ts = || {
        vec![
            TensorLayout::new("a", DType::U8, [3, 3], Placement::replicated(2)),
            TensorLayout::new("b", DType::F32, [2, 2], Placement::rows(&[1, 1])),
            TensorLayout::new("c", DType::U8, [1, 1], Placement::rows(&[0, 1])),
        ]
    };
    let l = model(2, ts());
    assert_eq!((l.offset(0, 0), l.offset(0, 1), l.offset(0, 2), l.buffer_len(0)), (Some(0), Some(64), Some(128), Some(128)));
    assert_eq!((l.offset(1, 2), l.buffer_len(1)), (Some(128), Some(129)));
    let packed = ModelLayout::with_align(2, ts(), 1).unwrap();
    assert_eq!((packed.offset(0, 1), packed.offset(1, 2), packed.buffer_len(1)), (Some(9), Some(17), Some(18)));
    assert_eq!(l.offset(2, 0), None);
    // Source and destination may list the tensors in different orders.
    let mut rev = ts();
    rev.reverse();
    route(&packed, &model(2, rev));
}

#[test]
fn replicas_share_the_load() {
    // 4 replicas to 1 receiver: each sends a quarter.
    let src = one(4, DType::Bf16, [64, 32], Placement::replicated(4));
    let t = route(&src, &one(1, DType::Bf16, [64, 32], Placement::replicated(1)));
    assert!((0..4).all(|s| t.bytes_from(s) == 64 * 32 * 2 / 4), "{t}");
    assert_eq!(t.pieces().len(), 4);
    // 4 replicas to 2 row shards: each shard split between two senders.
    let t = route(&src, &one(2, DType::Bf16, [64, 32], Placement::rows(&[32, 32])));
    assert!((0..4).all(|s| t.bytes_from(s) == 64 * 32 * 2 / 4), "{t}");
    // A 2 x 2 mesh (shard r % 2) to 3 uneven row shards.
    let src = one(4, DType::F32, [12, 8], Placement::rows_replicated(&[6, 6], 2));
    assert_eq!(src.block(3, 0), Some(Block::new(6, 6, 0, 8)));
    let t = route(&src, &one(3, DType::F32, [12, 8], Placement::rows(&[5, 5, 2])));
    assert!((0..4).all(|s| t.bytes_from(s) == 12 * 8 * 4 / 4), "{t}");
    // Replicated across many tensors: whole tensors, balanced overall.
    let ts = |p: &dyn Fn() -> Placement| (0..8).map(|i| TensorLayout::new(format!("t{i}"), DType::F32, [4, 4], p())).collect::<Vec<_>>();
    let t = route(&model(4, ts(&|| Placement::replicated(4))), &model(2, ts(&|| Placement::replicated(2))));
    assert!((0..4).all(|s| t.bytes_from(s) == 8 * 64 * 2 / 4), "{t}");
}

#[test]
fn one_row_cells_are_shared_by_columns() {
    let src = one(3, DType::U8, [1, 10], Placement::replicated(3));
    let t = route(&src, &one(1, DType::U8, [1, 10], Placement::replicated(1)));
    let mut sent: Vec<usize> = (0..3).map(|s| t.bytes_from(s)).collect();
    sent.sort_unstable();
    assert_eq!(sent, [3, 3, 4]);
}

#[test]
fn explain_names_tensors_ranks_and_shapes() {
    let w = |p| TensorLayout::new("layer0.weight", DType::Bf16, [4096, 4096], p);
    let b = |p| TensorLayout::vector("layer0.bias", DType::F32, 4096, p);
    let src = model(2, vec![w(Placement::rows(&[2048, 2048])), b(Placement::replicated(2))]);
    let dst = model(2, vec![w(Placement::cols(&[2048, 2048])), b(Placement::rows(&[2048, 2048]))]);
    let t = route(&src, &dst);
    let text = t.explain(&src, &dst);
    for want in [
        "layer0.weight [4096 x 4096] bf16:",
        "rank 0 -> rank 1 rows 0..2048 cols 2048..4096 (8 MiB, 2048 rows of 4 KiB, strided)",
        "layer0.bias [4096 x 1] f32:",
        "-> rank 0 rows 0..2048 (8 KiB, contiguous)",
        "rank 0 sends 16 MiB in 3 pieces",
        "rank 1 receives 16 MiB in 3 pieces",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    assert!(t.to_string().contains("4 source ranks") || t.to_string().contains("2 source ranks"));
    // With the groups' world ranks: both names.
    let text = t.explain_world(&src, &dst, &[0, 1], &[2, 3]);
    for want in [
        "rank 0 (world 0) -> rank 1 (world 3) rows 0..2048 cols 2048..4096",
        "rank 1 (world 1) sends 16 MiB",
        "rank 1 (world 3) receives 16 MiB",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn errors_name_the_tensor_and_never_panic() {
    let w = |name: &str, dtype, shape, p| TensorLayout::new(name, dtype, shape, p);
    let src = model(1, vec![w("a", DType::F32, [4, 4], Placement::replicated(1))]);
    let cases = [
        (model(1, vec![w("b", DType::F32, [4, 4], Placement::replicated(1))]), "`b` is in the destination layout only"),
        (model(1, vec![w("a", DType::F32, [4, 5], Placement::replicated(1))]), "shape [4 x 4] in the source"),
        (model(1, vec![w("a", DType::Bf16, [4, 4], Placement::replicated(1))]), "dtype f32 in the source layout, bf16"),
        (
            model(1, vec![w("a", DType::F32, [4, 4], Placement::replicated(1)), w("extra", DType::U8, [1, 1], Placement::replicated(1))]),
            "`extra` is in the destination layout only",
        ),
    ];
    for (dst, want) in cases {
        let e = RoutingTable::compute(&src, &dst).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    let e = RoutingTable::compute(&model(1, vec![]), &model(1, vec![w("x", DType::U8, [1, 1], Placement::replicated(1))])).unwrap_err();
    assert!(matches!(e, ReshardError::Missing { ref tensor, side: Side::Destination } if tensor == "x"), "{e}");

    // An element held by nobody.
    let holey = one(2, DType::F32, [4, 4], Placement::blocks(vec![Block::new(0, 4, 0, 2), Block::new(0, 3, 2, 2)]));
    let e = RoutingTable::compute(&holey, &one(1, DType::F32, [4, 4], Placement::replicated(1))).unwrap_err();
    assert_eq!(e, ReshardError::Uncovered { tensor: "w".into(), row: 3, col: 2 });
    assert!(e.to_string().contains("`w`: element (row 3, col 2) is held by no source rank"));

    // Layout errors.
    let bad = |ranks, p| ModelLayout::new(ranks, vec![w("q", DType::F32, [4, 4], p)]).unwrap_err();
    let e = bad(2, Placement::blocks(vec![Block::new(0, 4, 0, 4), Block::new(3, 2, 0, 1)]));
    assert!(matches!(e, ReshardError::BlockOutside { rank: 1, .. }), "{e}");
    assert!(e.to_string().contains("tensor `q`: rank 1's block (rows 3..5 cols 0..1) lies outside its shape [4 x 4]"), "{e}");
    assert!(matches!(bad(1, Placement::blocks(vec![Block::new(usize::MAX, 2, 0, 1)])), ReshardError::BlockOutside { .. }));
    assert!(matches!(bad(2, Placement::rows(&[1, 2])), ReshardError::ShardSizes { dim: "rows", sum: 3, extent: 4, .. }));
    assert!(matches!(bad(2, Placement::cols(&[usize::MAX, 2])), ReshardError::ShardSizes { dim: "cols", .. }));
    assert!(matches!(bad(3, Placement::replicated(2)), ReshardError::RankCount { placed: 2, ranks: 3, .. }));
    assert!(matches!(bad(2, Placement::rows_replicated(&[4], 0)), ReshardError::RankCount { placed: 0, .. }));
    assert!(matches!(ModelLayout::new(0, vec![]), Err(ReshardError::NoRanks { .. })));
    assert!(matches!(ModelLayout::with_align(1, vec![], 3), Err(ReshardError::BadAlign { align: 3 })));
    let dup =
        ModelLayout::new(1, vec![w("d", DType::U8, [1, 1], Placement::replicated(1)), w("d", DType::U8, [1, 1], Placement::replicated(1))]);
    assert!(matches!(dup, Err(ReshardError::DuplicateTensor { first: 0, second: 1, .. })));
    let huge = ModelLayout::new(1, vec![w("h", DType::F64, [usize::MAX, 2], Placement::replicated(1))]);
    assert!(matches!(huge, Err(ReshardError::TooLarge { rank: 0, .. })), "{huge:?}");
}

#[test]
fn verify_catches_broken_tables() {
    let src = one(2, DType::F32, [8, 8], Placement::rows(&[4, 4]));
    let dst = one(2, DType::F32, [8, 8], Placement::cols(&[4, 4]));
    let good = route(&src, &dst);
    let broken = |f: &dyn Fn(&mut Vec<Piece>)| {
        let mut t = good.clone();
        f(t.pieces_mut());
        t.verify(&src, &dst).unwrap_err()
    };
    let e = broken(&|p| p[0].src_offset += 4);
    assert!(e.contains("tensor `w`"), "{e}");
    broken(&|p| p[1] = p[0]);
    broken(&|p| p[0].rows = 1000);
    broken(&|p| p[0].dst_stride = 4);
    broken(&|p| p[0].region.row0 += 1);
    // One replica sending everything breaks the balance rule.
    let src = one(2, DType::F32, [8, 4], Placement::replicated(2));
    let dst = one(1, DType::F32, [8, 4], Placement::replicated(1));
    let mut t = route(&src, &dst);
    assert_eq!(t.pieces().len(), 2);
    t.pieces_mut().iter_mut().for_each(|p| p.src_rank = 0);
    let e = t.check_balance(&src, &[0], &dst).unwrap_err();
    assert!(e.contains("replica group [0, 1]") && e.contains("rank 0 sends 128"), "{e}");
    assert!(t.verify(&src, &dst).is_err());
    // A table for other layouts.
    let src = one(2, DType::F32, [8, 8], Placement::rows(&[4, 4]));
    assert!(good.verify(&src, &one(2, DType::F32, [8, 8], Placement::rows(&[4, 4]))).is_err());
    assert!(good.verify(&src, &one(3, DType::F32, [8, 8], Placement::rows(&[4, 4, 0]))).is_err());
}

/// A small deterministic generator (splitmix64) for random models.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=n`.
    fn upto(&mut self, n: usize) -> usize {
        (self.next() % (n as u64 + 1)) as usize
    }

    /// `extent` split into `k` parts (zeros allowed).
    fn split(&mut self, extent: usize, k: usize) -> Vec<usize> {
        let mut cuts: Vec<usize> = (0..k - 1).map(|_| self.upto(extent)).collect();
        cuts.push(0);
        cuts.push(extent);
        cuts.sort_unstable();
        cuts.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn block(&mut self, [rows, cols]: [usize; 2]) -> Block {
        let (r0, c0) = (self.upto(rows), self.upto(cols));
        Block::new(r0, self.upto(rows - r0), c0, self.upto(cols - c0))
    }

    /// A placement of every kind; for a source (`cover`), one that holds every element.
    fn placement(&mut self, shape: [usize; 2], ranks: usize, cover: bool) -> Placement {
        match self.upto(4) {
            0 => Placement::replicated(ranks),
            1 => Placement::rows(&self.split(shape[0], ranks)),
            2 => Placement::cols(&self.split(shape[1], ranks)),
            3 => {
                let divisors: Vec<usize> = (1..=ranks).filter(|&d| ranks.is_multiple_of(d)).collect();
                let shards = divisors[self.upto(divisors.len() - 1)];
                Placement::rows_replicated(&self.split(shape[0], shards), ranks / shards)
            }
            _ => {
                let mut blocks: Vec<Block> = (0..ranks).map(|_| self.block(shape)).collect();
                if cover {
                    // A grid of a x b blocks over the first ranks, the rest random.
                    let a = 1 + self.upto(ranks - 1);
                    let b = 1 + self.upto(ranks / a - 1);
                    let (rs, cs) = (self.split(shape[0], a), self.split(shape[1], b));
                    let mut r0 = 0;
                    for (i, &r) in rs.iter().enumerate() {
                        let mut c0 = 0;
                        for (j, &c) in cs.iter().enumerate() {
                            blocks[i * b + j] = Block::new(r0, r, c0, c);
                            c0 += c;
                        }
                        r0 += r;
                    }
                    let shift = self.upto(ranks - 1);
                    blocks.rotate_right(shift);
                }
                Placement::blocks(blocks)
            }
        }
    }

    fn models(&mut self, m: usize, n: usize) -> (ModelLayout, ModelLayout) {
        let dtypes = [DType::F32, DType::Bf16, DType::U8, DType::F64];
        let mut s = Vec::new();
        let mut d = Vec::new();
        for i in 0..1 + self.upto(5) {
            let shape = [self.upto(64), self.upto(64)];
            let dtype = dtypes[self.upto(3)];
            s.push(TensorLayout::new(format!("t{i}"), dtype, shape, self.placement(shape, m, true)));
            d.push(TensorLayout::new(format!("t{i}"), dtype, shape, self.placement(shape, n, false)));
        }
        let align = 1 << self.upto(7);
        (ModelLayout::with_align(m, s, align).unwrap(), ModelLayout::with_align(n, d, align).unwrap())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn random_models_route_exactly_and_deterministically(seed in any::<u64>(), m in 1usize..=4, n in 1usize..=4) {
        let (src, dst) = Gen(seed).models(m, n);
        let t = RoutingTable::compute(&src, &dst).unwrap();
        prop_assert_eq!(t.verify(&src, &dst), Ok(()));
        prop_assert_eq!(&t, &RoutingTable::compute(&src, &dst).unwrap());
        prop_assert!(coverage_counts(&t, &src, &dst).is_ok());
        let want: usize = (0..n)
            .map(|d| (0..dst.tensors().len()).map(|i| dst.block(d, i).unwrap().elems() * dst.tensors()[i].dtype().size()).sum::<usize>())
            .sum();
        prop_assert_eq!((0..m).map(|s| t.bytes_from(s)).sum::<usize>(), want);
        prop_assert_eq!((0..n).map(|d| t.bytes_to(d)).sum::<usize>(), want);
        for s in 0..m {
            prop_assert_eq!(t.pieces_from(s).map(Piece::bytes).sum::<usize>(), t.bytes_from(s));
        }
    }

    #[test]
    fn random_placements_never_panic(seed in any::<u64>(), m in 1usize..=4, n in 1usize..=4) {
        // Destination placements as sources: may leave holes (an error), never a panic.
        let mut g = Gen(seed);
        let shape = [g.upto(16), g.upto(16)];
        let src = ModelLayout::new(m, vec![TensorLayout::new("x", DType::U8, shape, g.placement(shape, m, false))]);
        let dst = ModelLayout::new(n, vec![TensorLayout::new("x", DType::U8, shape, g.placement(shape, n, false))]);
        if let (Ok(src), Ok(dst)) = (src, dst) {
            if let Ok(t) = RoutingTable::compute(&src, &dst) {
                prop_assert_eq!(t.verify(&src, &dst), Ok(()));
            }
        }
    }
}

#[test]
fn a_thousand_tensors_over_64_by_64_ranks() {
    let (m, n) = (64, 64);
    let mut g = Gen(13);
    let mut s = Vec::new();
    let mut d = Vec::new();
    for i in 0..1000 {
        let shape = [64 * (1 + g.upto(3)), 32 * (1 + g.upto(3))];
        let dtype = [DType::Bf16, DType::F32][g.upto(1)];
        let src_p = match i % 4 {
            0 => Placement::rows(&g.split(shape[0], m)),
            1 => Placement::replicated(m),
            2 => Placement::rows_replicated(&g.split(shape[0], 8), 8),
            _ => Placement::cols(&g.split(shape[1], m)),
        };
        let dst_p = match i % 3 {
            0 => Placement::cols(&g.split(shape[1], n)),
            1 => Placement::rows(&g.split(shape[0], n)),
            _ => Placement::rows_replicated(&g.split(shape[0], 16), 4),
        };
        s.push(TensorLayout::new(format!("layers.{i}.weight"), dtype, shape, src_p));
        d.push(TensorLayout::new(format!("layers.{i}.weight"), dtype, shape, dst_p));
    }
    let (src, dst) = (model(m, s), model(n, d));
    let start = std::time::Instant::now();
    let t = RoutingTable::compute(&src, &dst).unwrap();
    eprintln!("1,000 tensors, 64 -> 64 ranks: {} pieces in {:?}", t.pieces().len(), start.elapsed());
    // The table itself, pinned (the digest of the first implementation's table, before
    // the counting sort and the single-holder shortcut): a faster computation must give
    // this very table.
    let mut h = Fingerprint::new();
    for p in t.pieces() {
        for v in [p.tensor, p.src_rank, p.dst_rank, p.src_offset, p.dst_offset, p.rows, p.row_bytes, p.src_stride, p.dst_stride] {
            h.usize(v);
        }
        h.usize(p.region.row0).usize(p.region.rows).usize(p.region.col0).usize(p.region.cols);
    }
    assert_eq!(h.finish(), 0x0f4a_c612_7d57_82cc, "table digest {:#018x}", h.finish());
    coverage_counts(&t, &src, &dst).unwrap();
    t.check_balance(&src, &(0..1000).collect::<Vec<_>>(), &dst).unwrap();
    let want: usize =
        (0..n).map(|r| (0..1000).map(|i| dst.block(r, i).unwrap().elems() * dst.tensors()[i].dtype().size()).sum::<usize>()).sum();
    assert_eq!((0..m).map(|r| t.bytes_from(r)).sum::<usize>(), want);
    assert_eq!((0..n).map(|r| t.bytes_to(r)).sum::<usize>(), want);
}

#[test]
fn fingerprints_are_equal_for_equal_layouts_and_differ_for_any_change() {
    let t = |name: &str, dtype, shape, p| TensorLayout::new(name, dtype, shape, p);
    let base = || vec![t("w", DType::Bf16, [8, 4], Placement::rows(&[4, 4])), t("b", DType::F32, [8, 1], Placement::replicated(2))];
    let a = model(2, base());
    assert_eq!(a.fingerprint(), model(2, base()).fingerprint(), "built twice");
    assert_eq!(a.fingerprint(), a.clone().fingerprint());
    // The same blocks given another way: the same buffers and tables, the same fingerprint.
    let same = model(
        2,
        vec![
            t("w", DType::Bf16, [8, 4], Placement::blocks(vec![Block::new(0, 4, 0, 4), Block::new(4, 4, 0, 4)])),
            t("b", DType::F32, [8, 1], Placement::replicated(2)),
        ],
    );
    assert_eq!(a.fingerprint(), same.fingerprint());
    // Pinned: the encoding is the same on every rank, build and platform (a change to it
    // must change its version tag, and this value; FNV-1a written independently, in
    // Python, over the encoding the docs describe gives the same).
    assert_eq!(a.fingerprint(), 0x302c_c374_7c9c_38f4, "{:#018x}", a.fingerprint());

    let changed = [
        ("a renamed tensor", model(2, vec![t("v", DType::Bf16, [8, 4], Placement::rows(&[4, 4])), base()[1].clone()])),
        ("another dtype", model(2, vec![t("w", DType::F16, [8, 4], Placement::rows(&[4, 4])), base()[1].clone()])),
        ("another shape", model(2, vec![t("w", DType::Bf16, [8, 2], Placement::rows(&[4, 4])), base()[1].clone()])),
        ("other shards", model(2, vec![t("w", DType::Bf16, [8, 4], Placement::rows(&[2, 6])), base()[1].clone()])),
        ("columns, not rows", model(2, vec![t("w", DType::Bf16, [8, 4], Placement::cols(&[2, 2])), base()[1].clone()])),
        (
            "ranks swapped",
            model(2, vec![t("w", DType::Bf16, [8, 4], Placement::rows(&[4, 4])), t("b", DType::F32, [8, 1], Placement::rows(&[0, 8]))]),
        ),
        ("the tensors reordered", model(2, base().into_iter().rev().collect())),
        ("a tensor fewer", model(2, base()[..1].to_vec())),
        ("another alignment", ModelLayout::with_align(2, base(), 128).unwrap()),
        (
            "more ranks",
            model(3, vec![t("w", DType::Bf16, [8, 4], Placement::rows(&[4, 4, 0])), t("b", DType::F32, [8, 1], Placement::replicated(3))]),
        ),
    ];
    let mut seen = vec![a.fingerprint()];
    for (what, m) in &changed {
        let f = m.fingerprint();
        assert!(!seen.contains(&f), "{what}: fingerprint {f:#018x} seen before");
        seen.push(f);
    }
    // Name and dtype bytes are length-prefixed: moving a byte between fields changes it.
    let ab = model(1, vec![t("ab", DType::U8, [1, 1], Placement::replicated(1)), t("c", DType::U8, [1, 1], Placement::replicated(1))]);
    let a_bc = model(1, vec![t("a", DType::U8, [1, 1], Placement::replicated(1)), t("bc", DType::U8, [1, 1], Placement::replicated(1))]);
    assert_ne!(ab.fingerprint(), a_bc.fingerprint());
}
