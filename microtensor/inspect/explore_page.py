"""The explorer's page: one HTML file with its style, script and data inlined.

The script lays the graph out itself (longest-path layers top to bottom, barycentric
ordering within a layer with each module group kept together, long edges routed through
dummy points) and draws it as inline SVG. It exposes `window.explorer` for tests and for
the curious: nodeCount(), renderedCount(), select(id), selectedInfo(), step(), back(),
reset(), play(), pause(), litOrder(), order(), fold(name), unfold(name), unfoldAll(),
search(text). Nothing is fetched: no URL appears in the page.
"""
import html
import json
import math

__all__ = ["render_page"]

CSS = r"""
*{box-sizing:border-box}
body{margin:0;font:13px/1.35 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;
 color:#222;display:flex;flex-direction:column;height:100vh;background:#fafafa}
header{padding:6px 10px;border-bottom:1px solid #ccc;background:#fff;display:flex;
 flex-wrap:wrap;gap:6px 14px;align-items:center}
header h1{font-size:15px;margin:0}
header .meta{color:#555}
button{font:inherit;padding:2px 8px;border:1px solid #aaa;border-radius:4px;background:#f4f4f4;
 cursor:pointer}
button:hover{background:#e6eefa}
#search{width:190px;padding:2px 6px;font:inherit}
#results{position:absolute;z-index:5;background:#fff;border:1px solid #aaa;max-height:300px;
 overflow:auto;min-width:260px;display:none}
#results div{padding:2px 6px;cursor:pointer;white-space:nowrap}
#results div:hover{background:#e6eefa}
main{flex:1;display:flex;min-height:0}
#graph{flex:1;overflow:auto;position:relative;background:#fff}
#panel{width:360px;border-left:1px solid #ccc;overflow:auto;padding:8px 10px;background:#fcfcfc}
#panel h2{font-size:14px;margin:2px 0 6px;word-break:break-all}
#panel h3{font-size:12px;margin:10px 0 3px;color:#444;text-transform:uppercase;letter-spacing:.03em}
#panel table{border-collapse:collapse;font-size:12px}
#panel td{padding:1px 8px 1px 0;vertical-align:top;white-space:nowrap}
#panel td a{white-space:normal;word-break:break-all}
#panel td:first-child{color:#666}
#panel code{background:#f0f0f0;padding:2px 4px;display:block;white-space:pre-wrap;font-size:12px}
#panel a{color:#1a56b0;cursor:pointer;text-decoration:underline}
.legend{display:flex;align-items:center;gap:6px;font-size:12px}
.legend .bar{width:140px;height:10px;border:1px solid #888}
svg text{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:11px}
.node rect{stroke:#777;stroke-width:1}
.node{cursor:pointer}
.node.op rect{fill:#ececec}.node.param rect{fill:#bcd8f0}.node.leaf rect{fill:#fff2a8}
.node.group rect{fill:#d6efcf;stroke:#4a8a3c;stroke-width:1.5}
.node.resid rect{stroke:#d05000;stroke-width:2}
.node.lit rect{fill:#ffc98a}.node.now rect{fill:#ff7f2a;stroke:#a03000;stroke-width:2.5}
.node.reached rect{fill:#d9c3f0}
.node.partlit rect{fill:#f3dcb0}
.node.sel rect{stroke:#1060e0;stroke-width:3}
.node.match rect{stroke:#e000a0;stroke-width:3}
.node .sub{fill:#555;font-size:10px}
.gbox{fill:#5a8a50;fill-opacity:.05;stroke:#5a8a50;stroke-dasharray:4 3}
.glabel{fill:#3a6a30;font-size:10px;cursor:pointer}
.edge{fill:none;stroke-width:1.6}
.edge.skip{stroke-width:3.2}
.edge.wait{stroke:#cfcfcf!important;stroke-dasharray:3 3}
.note{fill:#a04000;font-size:10px}
"""

BODY = r"""
<header>
 <h1 id="title"></h1><span class="meta" id="meta"></span>
 <span><button id="b-reset" title="back to the start">reset</button>
 <button id="b-back" title="one node back">&#9664;</button>
 <button id="b-step" title="one node forward in the backward pass">&#9654;</button>
 <button id="b-play" title="play the backward pass">play</button>
 <span id="stepinfo"></span></span>
 <span><button id="b-fold">fold blocks</button> <button id="b-unfold">unfold all</button>
 <button id="b-zin">+</button><button id="b-zout">&minus;</button></span>
 <span style="position:relative"><input id="search" placeholder="search: name, op, module">
 <div id="results"></div></span>
 <span class="legend">edge: |gradient| sent back along it (log)
 <span id="lo"></span><span class="bar" id="bar"></span><span id="hi"></span></span>
</header>
<main><div id="graph"></div><div id="panel"></div></main>
"""

JS = r"""
(function(){
const D=JSON.parse(document.getElementById('explorer-data').textContent);
const N={},G={},kids={};D.nodes.forEach(n=>{N[n.id]=n;n.ins=[];n.outs=[];});
D.edges.forEach(e=>{N[e.t].ins.push(e);N[e.s].outs.push(e);});
(D.residuals||[]).forEach(r=>{if(N[r.node]&&N[r.node].residual)N[r.node].residual.at=N[r.stream]?doneAt(N[r.stream]):null;});
D.groups.forEach(g=>{G[g.name]=g;(kids[g.parent]=kids[g.parent]||[]).push(g.name);});
const S={step:0,sel:null,zoom:1,timer:null,matches:new Set(),pos:{}};
const esc=s=>String(s).replace(/[&<>"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
const fmt=v=>v==null?'–':(v===0?'0':(Math.abs(v)>=1e4||Math.abs(v)<1e-3?v.toExponential(3):v.toPrecision(4)));
const short=n=>n.kind==='op'?n.label.replace('Backward',''):n.label;
const anc=g=>{const a=[];while(g){a.unshift(g);g=G[g]?G[g].parent:null;}return a;};
function rep(id){const n=N[id];if(!n)return id;for(const g of anc(n.group))if(G[g].folded)return 'g:'+g;return id;}
const members=g=>D.nodes.filter(n=>anc(n.group).includes(g));
// colour scale: log10 |g| over all edges
const norms=D.edges.map(e=>e.norm).filter(v=>v>0),LO=Math.log10(Math.min(...norms,1)),HI=Math.log10(Math.max(...norms,1));
const STOPS=[[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
function color(v){if(!(v>0))return '#bbb';let t=HI>LO?(Math.log10(v)-LO)/(HI-LO):1;t=Math.max(0,Math.min(1,t))*(STOPS.length-1);
 const i=Math.min(Math.floor(t),STOPS.length-2),f=t-i,c=STOPS[i].map((a,k)=>Math.round(a+(STOPS[i+1][k]-a)*f));return `rgb(${c})`;}
// ---- layout ---------------------------------------------------------------------
// By group, inside out: each unfolded group is laid out on its own (its members in
// longest-path layers, barycentric order, pulled towards their neighbours), then takes
// the place of one box in the layout of the group around it. So sibling group boxes
// never overlap, and a node lies inside exactly the boxes of its module path.
const PAD=10,TOP=20,GX=26,GY=44,NOTE=112;
function layout(){
 const U={},order=[];
 const unit=id=>{if(!U[id]){const g=id.startsWith('g:')?id.slice(2):null;const m=g?members(g):null;
  const lab=g?g+' · '+(G[g].type||'module'):short(N[id]);
  const sub=g?m.filter(n=>n.kind==='op').length+' ops, '+m.filter(n=>n.kind!=='op').length+' leaves':'('+N[id].shape.join(', ')+')';
  const w=Math.max(lab.length,sub.length)*6.8+18;
  U[id]={id,g,lab,sub,w,h:34,span:w+(!g&&N[id].residual?NOTE:0),
   path:anc(g?G[g].parent:N[id].group).filter(a=>!G[a].folded)};order.push(id);}return U[id];};
 D.nodes.forEach(n=>unit(rep(n.id)));
 const E={};D.edges.forEach(e=>{const a=rep(e.s),b=rep(e.t);if(a===b)return;const k=a+'>'+b;
  if(!E[k])E[k]={s:a,t:b,norm:null,skip:false,orig:[],pts:[]};const x=E[k];x.orig.push(e);x.skip=x.skip||e.skip;
  if(e.norm!=null)x.norm=Math.max(x.norm||0,e.norm);});
 const edges=Object.values(E);
 const rect={};
 // one group's (or the root's, k = 0) contents: their sizes and places relative to it
 function block(c,k){
  const inside=order.map(id=>U[id]).filter(u=>k===0||u.path[k-1]===c);
  const keyOf=u=>u.path[k]!==undefined?'G:'+u.path[k]:u.id;
  const items={},list=[];
  inside.forEach(u=>{const key=keyOf(u);if(items[key])return;
   const it=key.startsWith('G:')?{key,sub:block(u.path[k],k+1)}:{key,u};
   it.w=it.sub?it.sub.w:u.span;it.h=it.sub?it.sub.h:u.h;it.up=[];it.dn=[];items[key]=it;list.push(it);});
  // the edges between this block's items (an edge lives in the deepest block holding both ends)
  const IE={};edges.forEach(e=>{const a=U[e.s],b=U[e.t];if(k&&(a.path[k-1]!==c||b.path[k-1]!==c))return;
   const ka=keyOf(a),kb=keyOf(b);if(ka===kb)return;const key=ka+'>'+kb;
   (IE[key]=IE[key]||{s:items[ka],t:items[kb],edges:[]}).edges.push(e);});
  const ies=Object.values(IE);ies.forEach(ie=>{(ie.s.outs=ie.s.outs||[]).push(ie);(ie.t.ins=ie.t.ins||[]).push(ie);});
  // longest-path layers; an edge that closes a cycle (folding can make one) is ignored
  const L=new Map(),st=new Map();const visit=it=>{if(st.get(it)===2)return L.get(it);if(st.get(it)===1)return -1;st.set(it,1);
   let l=0;(it.ins||[]).forEach(ie=>{const p=visit(ie.s);if(p<0)ie.back=true;else l=Math.max(l,p+1);});st.set(it,2);L.set(it,l);return l;};
  list.forEach(visit);
  list.forEach(it=>{const outs=(it.outs||[]).filter(ie=>!ie.back);if(!(it.ins||[]).some(ie=>!ie.back)&&outs.length)L.set(it,Math.min(...outs.map(ie=>L.get(ie.t)))-1);});
  let nl=0;list.forEach(it=>nl=Math.max(nl,L.get(it)+1));
  const rows=Array.from({length:nl},()=>[]);list.forEach(it=>rows[L.get(it)].push(it));
  // dummy points for item edges longer than one layer, and for edges that enter this
  // block from outside (from its top row down to their node) or leave it (down to its
  // bottom row): so an edge runs between boxes, not across them
  const chainOf=(from,to,lo,hi)=>{const pts=[];for(let l=lo;l<=hi;l++){const d={dummy:true,w:10,h:10,up:[],dn:[]};rows[l].push(d);pts.push(d);}
   const chain=[from,...pts,to].filter(Boolean);for(let i=0;i+1<chain.length;i++){chain[i].dn.push(chain[i+1]);chain[i+1].up.push(chain[i]);}return pts;};
  ies.forEach(ie=>{ie.pts=ie.back?[]:chainOf(ie.s,ie.t,L.get(ie.s)+1,L.get(ie.t)-1);ie.edges.forEach(e=>e.mid=ie.pts);});
  if(k){const ports={};edges.forEach(e=>{const a=U[e.s],b=U[e.t],ain=a.path[k-1]===c,bin=b.path[k-1]===c;if(ain===bin)return;
   const it=items[keyOf(ain?a:b)],key=(ain?'out>':'in>')+it.key+'>'+(ain?e.t:e.s);
   if(!ports[key])ports[key]=ain?chainOf(it,null,L.get(it)+1,nl-1):chainOf(null,it,0,L.get(it)-1);
   (ain?(e.exits=e.exits||{}):(e.enters=e.enters||{}))[k]=ports[key];});}
  rows.forEach(r=>r.forEach((u,i)=>u.o=i));
  const bary=(u,nb)=>nb.length?nb.reduce((s,v)=>s+v.o,0)/nb.length:u.o;
  const sortRow=(r,f)=>{r.sort((a,b)=>f(a)-f(b));r.forEach((u,i)=>u.o=i);};
  for(let it=0;it<6;it++){for(let l=1;l<nl;l++)sortRow(rows[l],u=>bary(u,u.up));for(let l=nl-2;l>=0;l--)sortRow(rows[l],u=>bary(u,u.dn));}
  // x: the positions nearest (least squares) to what the neighbours want, in order and
  // with the gaps kept: isotonic regression (pool adjacent violators) on x minus gaps
  rows.forEach(r=>{let x=0;r.forEach(u=>{u.x=x;x+=u.w+GX;});});
  const place=(r,want)=>{let c=0;const cs=[],bl=[];r.forEach((u,i)=>{if(i)c+=r[i-1].w+GX;cs.push(c);
    bl.push({s:want(u)-c,n:1});while(bl.length>1&&bl[bl.length-2].s/bl[bl.length-2].n>bl[bl.length-1].s/bl[bl.length-1].n){const b=bl.pop();bl[bl.length-1].s+=b.s;bl[bl.length-1].n+=b.n;}});
   let i=0;bl.forEach(b=>{for(let q=0;q<b.n;q++,i++)r[i].x=b.s/b.n+cs[i];});};
  const mid=u=>u.x+(u.u?u.u.w:u.w)/2;   // a node's centre is its box's, not its note's
  const ctr=(nb,u)=>nb.length?nb.reduce((s,v)=>s+mid(v),0)/nb.length-(mid(u)-u.x):u.x;
  for(let it=0;it<8;it++){for(let l=1;l<nl;l++)place(rows[l],u=>ctr(u.up,u));for(let l=nl-2;l>=0;l--)place(rows[l],u=>ctr(u.dn,u));}
  for(let it=0;it<4;it++)for(let l=0;l<nl;l++)place(rows[l],u=>ctr([...u.up,...u.dn],u));
  let minx=Infinity,maxx=-Infinity;rows.forEach(r=>r.forEach(u=>{minx=Math.min(minx,u.x);maxx=Math.max(maxx,u.x+u.w);}));
  if(!isFinite(minx)){minx=0;maxx=0;}
  const pad=k?PAD:0,top=k?TOP:0;let y=top;
  rows.forEach(r=>{const h=Math.max(10,...r.map(u=>u.h));r.forEach(u=>{u.x+=pad-minx;u.y=u.dummy?y+h/2-5:y;});y+=h+GY;});
  const w=maxx-minx+2*pad,h=y-GY+(k?PAD:0);
  // absolute places, once the enclosing block knows where this one goes
  const put=(x0,y0)=>{list.forEach(it=>{if(it.sub){it.sub.put(x0+it.x,y0+it.y);rect[it.key.slice(2)]=[x0+it.x,y0+it.y,x0+it.x+it.w,y0+it.y+it.h];}
    else{it.u.x=x0+it.x;it.u.y=y0+it.y;}});rows.forEach(r=>r.forEach(u=>{if(u.dummy){u.ax=x0+u.x;u.ay=y0+u.y;}}));};
  return {w,h,put};
 }
 const root=block('',0);const M=40;root.put(M,M);
 const seq=(m,dir)=>Object.keys(m||{}).map(Number).sort((a,b)=>dir*(a-b)).flatMap(k=>m[k]);
 edges.forEach(e=>{e.pts=[...seq(e.exits,-1),...(e.mid||[]),...seq(e.enters,1)].map(d=>({x:d.ax,y:d.ay,w:d.w,h:d.h}));});
 return {U,order,edges,rect};
}
// ---- drawing --------------------------------------------------------------------
const graphDiv=document.getElementById('graph');let LAY=null;
function draw(){
 LAY=layout();const {U,order,edges,rect}=LAY;let W=0,H=0;order.forEach(id=>{const u=U[id];W=Math.max(W,u.x+u.w+200);H=Math.max(H,u.y+u.h+40);});
 const out=[`<svg id="svg" width="${W*S.zoom}" height="${H*S.zoom}" viewBox="0 0 ${W} ${H}"><defs><marker id="arr" viewBox="0 0 6 6" refX="5" refY="3" markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0L6,3L0,6z" fill="#666"/></marker></defs>`];
 Object.entries(rect).sort((a,b)=>anc(a[0]).length-anc(b[0]).length).forEach(([g,r])=>{out.push(`<rect class="gbox" data-g="${esc(g)}" x="${r[0]}" y="${r[1]}" width="${r[2]-r[0]}" height="${r[3]-r[1]}" rx="6"/><text class="glabel" data-fold="${esc(g)}" x="${r[0]+4}" y="${r[1]+11}">&#8863; ${esc(g)}</text>`);});
 edges.forEach(e=>{const a=U[e.s],b=U[e.t];const p=[[a.x+a.w/2,a.y+a.h],...e.pts.map(d=>[d.x+d.w/2,d.y+d.h/2]),[b.x+b.w/2,b.y]];
  let d=`M${p[0][0]},${p[0][1]}`;for(let i=1;i<p.length;i++){const m=(p[i-1][1]+p[i][1])/2;d+=`C${p[i-1][0]},${m} ${p[i][0]},${m} ${p[i][0]},${p[i][1]}`;}
  out.push(`<path class="edge${e.skip?' skip':''}" data-s="${esc(e.s)}" data-t="${esc(e.t)}" data-norm="${e.norm==null?'':e.norm}" stroke="${color(e.norm)}" d="${d}" marker-end="url(#arr)"><title>|g| ${fmt(e.norm)}${e.skip?' (skip connection)':''}</title></path>`);
  // between folded modules: the norm in words too (the gradient a block sends back)
  if((U[e.s].g||U[e.t].g)&&e.norm!=null&&p.length===2)out.push(`<text class="note" data-t="${esc(e.t)}" x="${(p[0][0]+p[1][0])/2+6}" y="${(p[0][1]+p[1][1])/2+4}">|g| ${fmt(e.norm)}</text>`);});
 order.forEach(id=>{const u=U[id],n=N[id];const cls=u.g?'group':n.kind+(n.residual?' resid':'');
  out.push(`<g class="node ${cls}" data-id="${esc(id)}" data-kind="${u.g?'group':n.kind}" data-op="${esc(u.g?'':n.op)}" data-lit="0" transform="translate(${u.x},${u.y})"><rect width="${u.w}" height="${u.h}" rx="5"/><text x="8" y="14">${esc(u.lab)}</text><text class="sub" x="8" y="28">${esc(u.sub)}</text>`);
  if(n&&n.residual)out.push(`<text class="note" data-at="${n.residual.at}" x="${u.w+6}" y="13">skip ${fmt(n.residual.skip)}</text><text class="note" data-at="${n.residual.at}" x="${u.w+6}" y="27">branch ${fmt(n.residual.branch)}</text>`);
  out.push('</g>');});
 out.push('</svg>');graphDiv.innerHTML=out.join('');
 graphDiv.dataset.rendered=renderedCount();paint();
}
function renderedCount(){return graphDiv.querySelectorAll('g.node:not([data-kind=group])').length;}
// ---- backward stepping ----------------------------------------------------------
function paint(){
 const lit=new Set(D.order.slice(0,S.step)),now=S.step?D.order[S.step-1]:null;
 graphDiv.querySelectorAll('g.node').forEach(el=>{const id=el.dataset.id;let on=false,part=false,reached=false;
  if(id.startsWith('g:')){const m=members(id.slice(2));const k=m.filter(n=>lit.has(n.id)).length;part=k>0;on=k>0&&k===m.filter(n=>n.kind==='op').length;}
  else{on=lit.has(id);const n=N[id];reached=n.kind!=='op'&&S.step>0&&n.outs.length>0&&n.outs.every(e=>lit.has(e.t));}
  el.classList.toggle('lit',on);el.classList.toggle('partlit',part&&!on);el.classList.toggle('reached',reached);
  el.classList.toggle('now',now!=null&&rep(now)===id);el.classList.toggle('sel',S.sel===id);el.classList.toggle('match',S.matches.has(id));
  el.dataset.lit=on?'1':'0';});
 graphDiv.querySelectorAll('path.edge').forEach(el=>{const t=el.dataset.t;let passed=true;
  if(S.step>0)passed=t.startsWith('g:')?members(t.slice(2)).some(n=>lit.has(n.id)):lit.has(t);el.classList.toggle('wait',!passed);});
 // a gradient's number shows once the backward pass has made it (before any step: all, final)
 graphDiv.querySelectorAll('text.note').forEach(el=>{let on=true;if(S.step>0){if(el.dataset.at)on=S.step>=+el.dataset.at;
  else{const t=el.dataset.t;on=t.startsWith('g:')?members(t.slice(2)).some(n=>lit.has(n.id)):lit.has(t);}}
  el.style.visibility=on?'visible':'hidden';});
 const n=now?N[now]:null;document.getElementById('stepinfo').textContent=`backward ${S.step} / ${D.order.length}`+(n?`: ${short(n)}`:'');
}
function step(){if(S.step<D.order.length){S.step++;paint();if(S.sel)panel();}return S.step;}
function back(){if(S.step>0){S.step--;paint();if(S.sel)panel();}return S.step;}
function reset(){pause();S.step=0;paint();if(S.sel)panel();return 0;}
// the number of backward steps after which a node's gradient is complete: an op's once
// its rule has run, a leaf's once every op reading it has (null: never)
function doneAt(n){if(n.kind==='op')return n.step==null?null:n.step+1;
 const t=n.outs.map(e=>N[e.t].step).filter(v=>v!=null);return t.length?Math.max(...t)+1:null;}
function pause(){if(S.timer){clearInterval(S.timer);S.timer=null;}document.getElementById('b-play').textContent='play';}
function play(){if(S.timer)return pause();if(S.step>=D.order.length)S.step=0;document.getElementById('b-play').textContent='pause';
 S.timer=setInterval(()=>{if(S.step>=D.order.length)pause();else step();},Math.max(40,6000/D.order.length));}
// ---- selection and the side panel -----------------------------------------------
function hist(st){if(!st||!st.hist)return '';const h=st.hist,mx=Math.max(...h,1),w=300/h.length;
 return `<svg width="310" height="70" class="hist"><g>${h.map((c,i)=>`<rect x="${i*w}" y="${56-54*c/mx}" width="${w-1}" height="${54*c/mx}" fill="#6a8fc8"><title>${c}</title></rect>`).join('')}</g><text x="0" y="68">${fmt(st.min)}</text><text x="300" y="68" text-anchor="end">${fmt(st.max)}</text></svg>`;}
function stats(st,field){if(!st)return '<p>none reached it</p>';
 const row=(k,v,f)=>`<tr><td>${k}</td><td ${f?`data-field="${f}" data-value="${v}"`:''}>${fmt(v)}</td></tr>`;
 let s='<table>'+row('norm',st.norm,field)+row('mean',st.mean)+row('std',st.std)+row('min',st.min)+row('max',st.max)+`<tr><td>numel</td><td>${st.numel}</td></tr>`;
 if(st.nonfinite)s+=`<tr><td>NaN/Inf</td><td style="color:#c00">${st.nonfinite}</td></tr>`;
 if(st.sample_every)s+=`<tr><td>histogram</td><td data-field="sample" data-value="${st.sample}" style="white-space:normal">of an even sample: every ${st.sample_every}th entry, ${st.sample} in all</td></tr>`;
 if(st.values)s+=`<tr><td>values</td><td>${st.values.map(fmt).join(', ')}</td></tr>`;return s+'</table>'+hist(st);}
const link=id=>`<a data-go="${esc(id)}">${esc(short(N[id]))}</a>`;
function panel(){const P=document.getElementById('panel'),id=S.sel;
 if(!id){P.innerHTML=`<h2>${esc(D.title)}</h2><p>Click a node to see its value and gradient. ▶ steps the backward pass in the engine's order; a green box is a folded module (click it, then unfold). Boxes: grey ops, blue parameters, yellow inputs; orange border: a residual addition (skip / branch: the norms of the gradient's two parts reaching its stream).</p><h3>parameters</h3><table><tr><td></td><td>|grad|</td><td>update</td></tr>${D.params.map(p=>`<tr><td>${link(p.id)}</td><td>${fmt(p.grad_norm)}</td><td>${fmt(p.ratio)}</td></tr>`).join('')}</table><p>update: ${esc(D.meta.update_kind)}</p>`;return;}
 if(id.startsWith('g:')){const g=G[id.slice(2)],m=members(g.name);P.innerHTML=`<h2>${esc(g.name)}</h2><p>${esc(g.type)}: ${m.filter(n=>n.kind==='op').length} ops, ${m.length} nodes. <button data-unfold="${esc(g.name)}">unfold</button></p><h3>parameters</h3><table>${m.filter(n=>n.param).map(n=>`<tr><td>${link(n.id)}</td><td>|g| ${fmt(n.param.grad_norm)}</td></tr>`).join('')}</table><h3>ops</h3>${m.filter(n=>n.kind==='op').map(n=>link(n.id)).join(', ')}`;return;}
 const n=N[id];let s=`<h2 data-field="label">${esc(n.label)}</h2><table><tr><td>id</td><td>${esc(n.id)}</td></tr><tr><td>op</td><td data-field="op">${esc(n.op)}</td></tr><tr><td>module</td><td>${esc(n.group||'–')}</td></tr><tr><td>shape</td><td data-field="shape">(${n.shape.join(', ')})</td></tr><tr><td>dtype</td><td data-field="dtype">${esc(n.dtype)}</td></tr>`;
 s+=`<tr><td>backward</td><td>${n.step!=null?`step ${n.step+1} of ${D.order.length}`:(n.kind==='op'?'not run':'leaf: its gradient is summed into .grad')}</td></tr></table>`;
 if(n.kind==='op')s+=`<h3>rule: forward</h3><code data-field="forward">${esc(n.forward||n.math||'(not stated)')}</code><h3>rule: backward</h3><code data-field="backward">${esc(n.backward||'(not stated)')}</code>`;
 const pready=S.step===0||(doneAt(n)!=null&&S.step>=doneAt(n));
 if(n.param)s+=`<h3>parameter</h3><table><tr><td>|grad|</td>${pready?`<td data-field="param-grad-norm" data-value="${n.param.grad_norm}">${fmt(n.param.grad_norm)}</td>`:'<td>not yet</td>'}</tr><tr><td>|weight|</td><td>${fmt(n.param.weight_norm)}</td></tr><tr><td>${esc(D.meta.update_kind)}</td><td data-field="update-ratio" data-value="${n.param.ratio}">${fmt(n.param.ratio)}</td></tr></table>`;
 if(n.residual&&(S.step===0||(n.residual.at!=null&&S.step>=n.residual.at)))s+=`<h3>residual addition</h3><table><tr><td>skip |g|</td><td data-field="skip">${fmt(n.residual.skip)}</td></tr><tr><td>branch |g|</td><td data-field="branch">${fmt(n.residual.branch)}</td></tr></table>`;
 const at=doneAt(n),ready=S.step===0||(at!=null&&S.step>=at);
 s+=`<h3>value</h3>${stats(n.value,'value-norm')}<h3>gradient${n.kind==='op'?' dL/d(output)':' (.grad)'}</h3>`;
 if(S.step===0)s+=`<p data-field="grad-when" data-when="final"><i>final: after the whole backward pass</i> (step it with ▶ to watch it arrive)</p>${stats(n.grad,'grad-norm')}`;
 else if(!ready)s+=`<p data-field="grad-when" data-when="waiting">not yet: ${at==null?'the backward pass never reaches it':`complete after step ${at} of ${D.order.length}; now at step ${S.step}`}</p>`;
 else s+=`<p data-field="grad-when" data-when="reached">complete since step ${at} (now at ${S.step})</p>${stats(n.grad,'grad-norm')}`;
 s+=`<h3>inputs</h3>${n.ins.map(e=>link(e.s)+` <small>|g| ${ready?fmt(e.norm):'not yet'}</small>`).join('<br>')||'–'}<h3>used by</h3>${n.outs.map(e=>link(e.t)).join('<br>')||'– (the root)'}`;
 P.innerHTML=s;}
function select(id,keepHash){if(id&&!N[id]&&!(id.startsWith('g:')&&G[id.slice(2)]))return false;
 if(id&&N[id]){let changed=false;anc(N[id].group).forEach(g=>{if(G[g].folded){G[g].folded=false;changed=true;}});if(changed)draw();}
 S.sel=id;panel();paint();if(!keepHash)history.replaceState(null,'',id?'#node='+encodeURIComponent(id):location.pathname);
 const el=id&&graphDiv.querySelector(`g.node[data-id="${CSS.escape(id)}"]`);if(el&&el.scrollIntoView)el.scrollIntoView({block:'center',inline:'center'});return true;}
function selectedInfo(){const id=S.sel;if(!id)return null;const n=N[id]||{};const f=k=>{const el=document.querySelector(`#panel [data-field="${k}"]`);return el?el:null;};
 const g=f('grad-norm'),pg=f('param-grad-norm');return {id,label:n.label,op:n.op,math:n.math,shape:n.shape,dtype:n.dtype,
  gradNorm:g&&g.dataset.value!==''?parseFloat(g.dataset.value):null,gradNormText:g?g.textContent:null,
  paramGradNorm:pg?parseFloat(pg.dataset.value):null,gradWhen:f('grad-when')?f('grad-when').dataset.when:null,forward:f('forward')?f('forward').textContent:null,backward:f('backward')?f('backward').textContent:null,panelText:document.getElementById('panel').textContent};}
function fromHash(){const m=/node=([^&]+)/.exec(location.hash);if(m)select(decodeURIComponent(m[1]),true);}
// ---- folding, search, zoom ------------------------------------------------------
function fold(name,on){if(!G[name])return false;G[name].folded=on!==false;if(S.sel&&!S.sel.startsWith('g:')&&S.sel!==rep(S.sel))S.sel=null;draw();panel();return true;}
function unfoldAll(){D.groups.forEach(g=>g.folded=false);draw();}
function foldBlocks(){D.groups.forEach(g=>g.folded=/\.\d+(#\d+)?$/.test(g.name));draw();}
function search(q){q=q.trim().toLowerCase();S.matches=new Set();const hits=q?D.nodes.filter(n=>(n.label+' '+n.op+' '+(n.group||'')+' '+n.id).toLowerCase().includes(q)):[];
 hits.forEach(n=>S.matches.add(rep(n.id)));paint();const R=document.getElementById('results');
 R.innerHTML=hits.slice(0,40).map(n=>`<div data-go="${esc(n.id)}">${esc(short(n))} <small>${esc(n.group||'')} (${n.shape.join(', ')})</small></div>`).join('');
 R.style.display=hits.length?'block':'none';return hits.map(n=>n.id);}
function zoom(f){S.zoom=Math.max(.2,Math.min(3,S.zoom*f));const s=document.getElementById('svg');const vb=s.viewBox.baseVal;s.setAttribute('width',vb.width*S.zoom);s.setAttribute('height',vb.height*S.zoom);}
document.addEventListener('click',ev=>{const t=ev.target;const go=t.closest('[data-go]');if(go){document.getElementById('results').style.display='none';select(go.dataset.go);return;}
 const uf=t.closest('[data-unfold]');if(uf){fold(uf.dataset.unfold,false);select('g:'+uf.dataset.unfold)&&select(null);return;}
 const fl=t.closest('[data-fold]');if(fl){fold(fl.dataset.fold,true);return;}
 const nd=t.closest('g.node');if(nd){select(nd.dataset.id);}});
document.addEventListener('dblclick',ev=>{const nd=ev.target.closest('g.node[data-kind=group]');if(nd)fold(nd.dataset.id.slice(2),false);});
const on=(id,f)=>document.getElementById(id).addEventListener('click',f);
on('b-step',step);on('b-back',back);on('b-reset',reset);on('b-play',play);on('b-fold',foldBlocks);on('b-unfold',unfoldAll);on('b-zin',()=>zoom(1.25));on('b-zout',()=>zoom(0.8));
const sb=document.getElementById('search');sb.addEventListener('input',()=>search(sb.value));
sb.addEventListener('keydown',ev=>{if(ev.key==='Enter'){const h=search(sb.value);if(h.length)select(h[0]);document.getElementById('results').style.display='none';}});
document.addEventListener('keydown',ev=>{if(ev.target===sb)return;if(ev.key==='ArrowRight')step();else if(ev.key==='ArrowLeft')back();else if(ev.key===' '){ev.preventDefault();play();}});
window.addEventListener('hashchange',fromHash);
document.getElementById('title').textContent=D.title;
document.getElementById('meta').textContent=`${D.nodes.length} nodes, ${D.meta.ops} ops`+(D.meta.loss!=null?`, loss ${fmt(D.meta.loss)}`:'');
document.getElementById('bar').style.background=`linear-gradient(to right,${STOPS.map(c=>`rgb(${c})`).join(',')})`;
document.getElementById('lo').textContent=fmt(Math.pow(10,LO));document.getElementById('hi').textContent=fmt(Math.pow(10,HI));
draw();panel();fromHash();
window.explorer={nodeCount:()=>D.nodes.length,renderedCount,select:id=>select(id),selectedInfo,step,back,reset,play,pause,
 litOrder:()=>D.order.slice(0,S.step),order:()=>D.order.slice(),fold:n=>fold(n,true),unfold:n=>fold(n,false),unfoldAll,foldBlocks,search,
 visible:()=>LAY.order.slice(),data:D,ready:true};
document.body.dataset.readyMs=Math.round(performance.now());document.body.dataset.ready='1';
})();
"""


def _clean(obj):
    """NaN and Inf (which JSON cannot hold) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _json_for_script(data):
    """JSON safe inside a <script> element: no '</' can end it early."""
    text = json.dumps(_clean(data), separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def render_page(data):
    """The whole page as one string: style, body, data, script."""
    title = html.escape(f"microtensor explorer: {data.get('title', '')}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{title}</title><style>{CSS}</style></head>\n<body>{BODY}"
            f'<script type="application/json" id="explorer-data">{_json_for_script(data)}</script>\n'
            f"<script>{JS}</script>\n</body></html>\n")
