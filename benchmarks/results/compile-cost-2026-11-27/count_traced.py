import re, collections, sys
cur=None; c=collections.Counter(); f=collections.Counter()
for l in open(sys.argv[1]):
    m=re.search(r'TRACE starts_line (\S+):(\d+) in (\S+)', l)
    if m: cur=(m.group(1).replace('/work/venv/lib/python3.11/site-packages/','').replace('/work/main/src/fully_shard/',''), m.group(3)); continue
    if 'TRACE ' in l and cur: c[cur]+=1; f[cur[0]]+=1
print(sum(c.values()))
for k,v in f.most_common(12): print(v,k)
print()
for k,v in c.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 30): print(v,k)
