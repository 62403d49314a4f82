"""Inner loops of the functions of an aarch64 objdump: per loop (a backward
branch's target .. the branch), instructions, vector FMAs (fmla/fmls, lanes
by arrangement), loads and their bytes, stores."""
import re, sys
dis = open(sys.argv[1]).read().splitlines()
want = sys.argv[2:]
funcs, cur = {}, None
for line in dis:
    m = re.match(r'^([0-9a-f]+) <(.*)>:$', line)
    if m:
        cur = m.group(2); funcs[cur] = []; continue
    m = re.match(r'^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$', line)
    if m and cur:
        funcs[cur].append((int(m.group(1), 16), m.group(2), m.group(3)))

def load_bytes(op, args):
    regs = re.findall(r'\b([qdsxwbh])(\d+)\b', args.split('[')[0])
    size = {'q': 16, 'd': 8, 's': 4, 'x': 8, 'w': 4, 'h': 2, 'b': 1}
    if op.startswith('ld1r'):
        return 4 if '.4s' in args else 8
    if op.startswith('ld1') :
        n = len(re.findall(r'v\d+\.', args.split('}')[0]))
        return 16 * n
    if op in ('ldrb', 'ldurb'): return 1
    if op in ('ldrh', 'ldurh'): return 2
    if op in ('ldrsw',): return 4
    return sum(size[r] for r, _ in regs)

for f in want:
    ins = funcs[f]
    addr = [a for a, _, _ in ins]
    for i, (a, op, args) in enumerate(ins):
        if not (op.startswith('b.') or op in ('b', 'cbnz', 'cbz', 'tbnz', 'tbz')): continue
        t = re.search(r'\b([0-9a-f]+) <', args)
        if not t: continue
        tgt = int(t.group(1), 16)
        if tgt > a or tgt < addr[0]: continue
        body = [x for x in ins if tgt <= x[0] <= a]
        fmla = [x for x in body if x[1] in ('fmla', 'fmls')]
        lanes = sum(4 if '.4s' in x[2] else 2 for x in fmla)
        loads = [x for x in body if x[1].startswith('ld')]
        lb = sum(load_bytes(x[1], x[2]) for x in loads)
        st = [x for x in body if x[1].startswith('st')]
        other = {}
        for x in body:
            if x[1] in ('fadd','fmul','fsub','fmax','fdiv','faddp','bsl','bit','bif','fcmgt','shl','frintn','fmadd'):
                other[x[1]] = other.get(x[1], 0) + 1
        print(f"{f} loop {tgt:x}-{a:x}: {len(body)} insns, {len(fmla)} fmla ({lanes} lane-FMAs), "
              f"{len(loads)} loads {lb} B, {len(st)} stores; lane-FMA/B = {lanes / lb if lb else float('nan'):.3f}"
              + (f"; {other}" if other else ""))
